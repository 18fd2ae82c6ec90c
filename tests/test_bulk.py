"""The loop's bulk writes (``webapp/common/bulk.py``, ``record_verdicts``, ``record_sample_facts``) store what
the ORM would: the same rows as ``bulk_create`` (defaults, JSON, times), conflicts skipped, a verdict that is
already there never overwritten."""

from __future__ import annotations

import pytest

from tests import factories
from webapp.common.bulk import insert_ignoring_conflicts
from webapp.runs.loop.training import record_sample_facts
from webapp.runs.loop.verification import record_verdicts
from webapp.runs.models import Trajectory
from workers.verifiers.base import Verdict

pytestmark = pytest.mark.django_db


def sample(run, key: str, index: int, **extra):
    return {"run_id": run.pk, "group_key": key, "sample_index": index, "version": 3, "prompt": "1+2=",
            "completion": "3", "prompt_token_ids": [49, 43, 50, 61], "completion_token_ids": [51, 256],
            "behaviour_logprobs": [-0.25, -1.5], "finish_reason": "stop", "turns": [], "stop_reason": "", **extra}


def test_inserted_rows_are_what_bulk_create_stores_and_a_conflict_is_skipped(user):
    run = factories.run(user)
    insert_ignoring_conflicts(Trajectory, [sample(run, "g1", 0), sample(run, "g1", 1, completion="4")])
    Trajectory.objects.bulk_create([Trajectory(**sample(run, "g2", 0))])
    insert_ignoring_conflicts(Trajectory, [sample(run, "g1", 0, completion="changed"), sample(run, "g1", 2)])
    ours = Trajectory.objects.get(run=run, group_key="g1", sample_index=0)
    theirs = Trajectory.objects.get(run=run, group_key="g2", sample_index=0)
    assert ours.completion == "3"  # the conflicting row was skipped, not replaced
    assert Trajectory.objects.filter(run=run, group_key="g1").count() == 3
    skip = {"id", "group_key", "created_at"}
    for field in Trajectory._meta.concrete_fields:
        if field.attname not in skip:
            assert getattr(ours, field.attname) == getattr(theirs, field.attname), field.attname
    assert ours.created_at is not None and ours.behaviour_logprobs == [-0.25, -1.5] and ours.verdict == "pending"
    with pytest.raises(ValueError, match="no fields"):
        insert_ignoring_conflicts(Trajectory, [sample(run, "g3", 0, bogus=1)])


def test_verdicts_and_sample_facts_are_written_once(user):
    run = factories.run(user)
    insert_ignoring_conflicts(Trajectory, [sample(run, "g", i) for i in range(3)])
    rows = list(Trajectory.objects.filter(run=run).order_by("sample_index"))
    record_verdicts([(rows[0], Verdict(1.0, "pass", details={"why": ["exact"]}, latency_ms=0.5)),
                     (rows[1], Verdict(None, "invalid", reason="no answer line"))])
    record_verdicts([(rows[0], Verdict(0.0, "fail"))])  # a redelivery changes nothing
    # a batch of which one sample was judged before: only the other is stored
    record_verdicts([(rows[1], Verdict(0.0, "fail")), (rows[2], Verdict(1.0, "pass"))])
    record_sample_facts({rows[0].pk: (0.75, True), rows[1].pk: (None, None)})
    got = {t.sample_index: t for t in Trajectory.objects.filter(run=run)}
    assert (got[0].verdict, got[0].reward, got[0].verifier_details, got[0].verify_latency_ms) == (
        "pass", 1.0, {"why": ["exact"]}, 0.5)
    assert (got[1].verdict, got[1].reward, got[1].verdict_reason) == ("invalid", None, "no answer line")
    assert (got[2].verdict, got[2].reward) == ("pass", 1.0)
    assert (got[0].advantage, got[0].clipped, got[1].advantage, got[1].clipped) == (0.75, True, None, None)
