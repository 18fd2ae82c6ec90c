"""Finishing judged groups (``verification.finish``): one statement per distinct outcome, each group's own."""

from __future__ import annotations

import pytest

from tests import factories
from webapp.runs.loop.verification import finish
from webapp.runs.models import PromptGroup

PASS, FAIL, INVALID, PENDING = ("pass", ""), ("fail", ""), ("invalid", "verifier crashed: boom"), ("pending", "")


@pytest.mark.django_db
def test_a_batch_of_groups_each_gets_its_own_outcome(user, django_assert_max_num_queries):
    run = factories.run(user)
    rows = {name: PromptGroup.objects.create(run=run, key=name, status="verifying", retries=retries, holder="w1")
            for name, retries in (("ok", 0), ("ok2", 0), ("some_invalid", 0), ("all_invalid", 0),
                                  ("all_invalid_last_try", 2), ("pending", 0), ("finished_elsewhere", 0))}
    PromptGroup.objects.filter(pk=rows["finished_elsewhere"].pk).update(status="ready")
    verdicts = {"ok": [PASS, FAIL], "ok2": [FAIL, PASS], "some_invalid": [PASS, INVALID],
                "all_invalid": [INVALID, INVALID], "all_invalid_last_try": [INVALID, INVALID],
                "pending": [PASS, PENDING], "finished_elsewhere": [PASS, PASS]}
    # a read, then one update per distinct outcome (4 here: the two plain ready groups share one)
    with django_assert_max_num_queries(7):
        done = finish([(rows[name], verdicts[name]) for name in rows], max_retries=2)
    by_name = {name: done.get(g.pk) for name, g in rows.items()}
    assert by_name == {"ok": "ready", "ok2": "ready", "some_invalid": "ready", "all_invalid": "dropped",
                       "all_invalid_last_try": "dropped", "pending": None, "finished_elsewhere": None}
    fresh = {g.key: g for g in PromptGroup.objects.filter(run=run)}
    assert fresh["ok"].invalid == 0 and not fresh["ok"].retry_pending and fresh["ok"].holder == ""
    assert fresh["some_invalid"].invalid == 1 and fresh["some_invalid"].retry_pending
    assert fresh["all_invalid"].status == "dropped" and fresh["all_invalid"].retry_pending
    assert fresh["all_invalid"].drop_reason == "every verdict invalid (verifier crashed: boom); prompt queued again"
    assert not fresh["all_invalid_last_try"].retry_pending
    assert fresh["all_invalid_last_try"].drop_reason.endswith("no retry left after 2")
    assert fresh["pending"].status == "verifying" and fresh["pending"].holder == "w1"
    assert fresh["finished_elsewhere"].status == "ready" and fresh["finished_elsewhere"].holder == "w1"


def test_a_group_is_announced_once_when_its_last_sample_is_judged():
    """``when_all_done``: the verify worker learns of each remotely judged group once, when its last
    verdict is in, whatever order the samples finish in (a group with none is done at once)."""
    from concurrent.futures import Future

    from webapp.runs.loop.verification import when_all_done

    announced: list[str] = []
    groups = {name: [Future() for _ in range(n)] for name, n in (("a", 3), ("b", 2), ("empty", 0))}
    for name, futures in groups.items():
        when_all_done(futures, lambda name=name: announced.append(name))
    assert announced == ["empty"]
    for future in (groups["a"][2], groups["b"][0], groups["a"][0]):
        future.set_result("pass")
    assert announced == ["empty"]  # each has a sample still out
    groups["b"][1].set_result("pass")
    groups["a"][1].set_exception(RuntimeError("judge thread died"))  # done, too: its result raises later
    assert announced == ["empty", "b", "a"]


def _judged_group(user, completions: list[str]):
    """A paused run's group of samples waiting for their verdicts (exact match against "3")."""
    from webapp.catalog.models import Task
    from webapp.common.bulk import insert_ignoring_conflicts
    from webapp.runs.models import Run, Trajectory

    run = factories.run(user)
    Run.objects.filter(pk=run.pk).update(status="paused")  # its next step is taken and does nothing
    domain = run.run_domains.get().domain
    task = Task.objects.create(domain=domain, prompt="1+2=", reference={"answer": "3"})
    group = PromptGroup.objects.create(run=run, key="g", status="verifying", domain=domain, task=task, holder="w1")
    insert_ignoring_conflicts(Trajectory, [
        {"run_id": run.pk, "group_key": "g", "sample_index": i, "version": 0, "prompt": "1+2=", "completion": c,
         "prompt_token_ids": [1], "completion_token_ids": [2], "behaviour_logprobs": [-0.5], "finish_reason": "stop",
         "turns": [], "stop_reason": ""} for i, c in enumerate(completions)])
    return run, group


@pytest.mark.django_db
def test_a_judged_group_counts_its_own_verdicts_and_an_earlier_deliverys(user):
    """``verify_groups``: the group's outcome counts the verdicts this delivery stored and those an earlier
    delivery stored (one sample was judged invalid before: the group has one invalid sample)."""
    from webapp.runs.loop.verification import verify_groups
    from webapp.runs.models import Trajectory

    run, group = _judged_group(user, ["3", "4", "3"])
    Trajectory.objects.filter(run=run, sample_index=2).update(verdict="invalid", verdict_reason="judged before")
    assert verify_groups([group.pk], holder="w2") == ["ready"]
    group.refresh_from_db()
    assert (group.status, group.invalid, group.retry_pending, group.holder) == ("ready", 1, True, "")
    assert group.verify_s is not None and group.verify_wait_s is not None
    assert list(Trajectory.objects.filter(run=run).order_by("sample_index").values_list("verdict", "reward")) == [
        ("pass", 1.0), ("fail", 0.0), ("invalid", None)]


@pytest.mark.django_db
def test_a_verdict_stored_first_by_another_delivery_is_the_one_the_outcome_counts(user, monkeypatch):
    """Another delivery stores a sample's verdict between this one's read and its write: this one's verdict
    for it is not stored, and the group's outcome counts the invalid verdict stored first, not this
    delivery's pass (an outcome taken from what this delivery judged would count the pass)."""
    from webapp.runs.loop import verification
    from webapp.runs.models import Trajectory

    run, group = _judged_group(user, ["3", "3"])
    real = verification.record_verdicts

    def racing(verdicts):
        Trajectory.objects.filter(run=run, sample_index=0).update(verdict="invalid", verdict_reason="the other one")
        return real(verdicts)

    monkeypatch.setattr(verification, "record_verdicts", racing)
    assert verification.verify_groups([group.pk], holder="w2") == ["ready"]
    group.refresh_from_db()
    assert (group.status, group.invalid, group.retry_pending) == ("ready", 1, True)
    assert list(Trajectory.objects.filter(run=run).order_by("sample_index").values_list("verdict", "reward")) == [
        ("invalid", None), ("pass", 1.0)]
