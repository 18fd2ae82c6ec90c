"""The tool demo learns, through the real loop: the seeded run ``demo: tool use`` (two-digit products, the
``python_tool`` environment, the primed base model in ``assets/base-models/demo-tool``; and sums answered in
the model's head, single-turn) started through the API, with real Redis, real Celery workers and real
sandbox sessions. Bounded by steps with a fixed seed, never by seconds: held-out accuracy on products
(greedy episodes) must rise by 40 points within 40 train steps, the tool-call rate must go from the base
model's occasional call to nearly always, and every stored episode must keep the token invariants
(measured: 3 % -> 99-100 % at step 10, in about 30 s on this machine).

Then layered evaluation: the run's versions are evaluated in two layers (capability items: the sums;
end-to-end: the product episodes). The best version goes to ``production``; a version planted from it by
training it to answer products without the tool (``train_without_the_tool``) regresses the end-to-end layer
only, and its promotion to ``production`` is refused, naming the layer and the domain.
"""

from __future__ import annotations

import shutil
import time

import pytest
from django.core.management import call_command
from transformers import AutoTokenizer

from tests.test_episodes_loop import stored_episode_problems
from tests.test_pipeline import wait_status
from webapp.runs.loop import paths
from webapp.runs.loop.accounting import accounting
from webapp.runs.models import Evaluation, MetricPoint, PolicyVersion, Run, Trajectory

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_the_tool_demo_learns_to_compute_products_with_the_tool(start_worker, api, user):
    from workers.policy.engines import load_engine

    call_command("seed_demo", user=user.username)
    run = Run.objects.get(owner=user, name="demo: tool use")
    assert run.status == "draft"  # left for the user to start from its page
    spec = {**run.spec, "max_steps": 40, "eval_tasks": 100}
    Run.objects.filter(pk=run.pk).update(spec=spec)
    start_worker("control")
    start_worker("rollout,train")
    start_worker("verify")
    assert api.post(f"/api/v1/runs/{run.pk}/start/", {}, format="json").status_code == 200
    run = wait_status(run.pk, {"completed"}, timeout=600)
    assert not accounting(run).problems

    scores = dict(Evaluation.objects.filter(version__run=run, suite="heldout", domain__name="product")
                  .values_list("version__number", "score"))
    assert scores[0] <= 0.1, scores  # the base model seldom solves a product
    assert max(scores.values()) >= scores[0] + 0.40, scores
    assert Evaluation.objects.filter(version__run=run, invalid_count__gt=0).count() == 0

    rate = list(MetricPoint.objects.filter(run=run, name="tool_call_rate").order_by("step")
                .values_list("value", flat=True))
    assert rate[0] < 0.5 and max(rate) >= 0.9, rate
    assert not Trajectory.objects.filter(run=run, stop_reason__in=("env_error", "session_error")).exists()

    decode = load_engine("torch", "assets/base-models/demo-tool").tokenizer.decode
    stored = list(Trajectory.objects.filter(run=run, domain__name="product").exclude(completion_token_ids=[]))
    assert stored
    for t in stored:
        assert not (problems := stored_episode_problems(t, decode)), (t.pk, problems)
    # the API filters episodes by stop reason and turn count
    body = api.get(f"/api/v1/trajectories/?run={run.pk}&stop_reason=done&turns_min=2&page_size=50").json()
    assert body["results"] and all(r["stop_reason"] == "done" and r["turn_count"] >= 2 for r in body["results"])
    # a rewarded episode called the tool, read its output and copied it
    passed = Trajectory.objects.filter(run=run, is_eval=True, verdict="pass", version__gt=0).first()
    assert passed is not None
    assert [t["role"] for t in passed.turns] == ["model", "env", "model"] and "<py>" in passed.turns[0]["text"]

    # layered evaluation, and a planted regression in the end-to-end layer only
    best = PolicyVersion.objects.get(run=run, number=max((n for n in scores if n > 0), key=lambda n: scores[n]))
    layers = api.get(f"/api/v1/policy-versions/{best.pk}/compare/?against=base").json()["layers"]
    assert layers["end_to_end"]["domains"] == ["product"] and layers["capability"]["domains"] == ["addition"]
    assert layers["end_to_end"]["gain"] >= 0.4 and not layers["capability"]["regressions"], layers
    promoted = api.post(f"/api/v1/policy-versions/{best.pk}/promote/", {"alias": "production"}, format="json")
    assert promoted.status_code == 200, promoted.json()
    wait_for_the_last_step(run, workers=3)
    plant = plant_answers_without_the_tool(run, best)
    assert api.post(f"/api/v1/policy-versions/{plant.pk}/evaluate/", {}, format="json").status_code == 202
    deadline = time.monotonic() + 300
    while Evaluation.objects.filter(version=plant, status=Evaluation.Status.DONE).count() < 2:
        assert time.monotonic() < deadline, list(Evaluation.objects.filter(version=plant).values("domain", "status"))
        time.sleep(0.5)
    body = api.get(f"/api/v1/policy-versions/{plant.pk}/compare/?against=production").json()
    assert body["layers"]["end_to_end"]["regressions"] == ["product"], body["layers"]
    assert body["layers"]["capability"]["regressions"] == [], body["layers"]
    refused = api.post(f"/api/v1/policy-versions/{plant.pk}/promote/", {"alias": "production"}, format="json")
    assert refused.status_code == 409, refused.json()
    assert "end-to-end layer: product regressed" in refused.json()["detail"]
    assert "capability layer" not in refused.json()["detail"]


def wait_for_the_last_step(run: Run, workers: int) -> None:
    """Return once no train step of ``run`` can still record a version. A step that was training when the run
    reached its target records its version after ``completed`` (its work is kept); a step that starts later
    finds the run ended and records nothing. So the run is settled when its train claim is gone or no worker
    is executing a train step (every one of the ``workers`` answering)."""
    from workers.celery import app
    from workers.messages import TRAIN_STEP

    deadline = time.monotonic() + 120
    while "train_claim" in Run.objects.get(pk=run.pk).state:
        active = app.control.inspect(timeout=1.0).active() or {}
        if len(active) >= workers and not any(t["name"] == TRAIN_STEP for tasks in active.values() for t in tasks):
            return
        assert time.monotonic() < deadline, ("a train step still runs", active)
        time.sleep(0.2)


def plant_answers_without_the_tool(run: Run, best: PolicyVersion) -> PolicyVersion:
    """A new version of ``run``: ``best`` trained to answer products directly, without the tool."""
    import torch

    from workers.policy.tool_demo_model import train_without_the_tool
    from workers.policy.versions import load_version, save_version

    base = paths.resolve_model_path(run.base_model)
    # after the newest version: the run is settled (wait_for_the_last_step), so nothing records one after it
    number = max(PolicyVersion.objects.filter(run=run).values_list("number", flat=True)) + 1
    target = paths.version_dir(run.pk, number)
    assert target is not None
    if target.exists():  # left by an earlier test run whose run had the same id
        shutil.rmtree(target)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_version(base, paths.version_dir(run.pk, best.number), trainable=True)
        after = train_without_the_tool(model, AutoTokenizer.from_pretrained(base))
        save_version(model, target, base_model_dir=base, version=number, parent=best.number, step=run.step)
    finally:
        torch.set_num_threads(threads)
    assert after["tool_rate"] <= 0.1, after  # the plant took: it no longer calls the tool
    Run.objects.filter(pk=run.pk).update(latest_version=number)  # the run has ended: nothing trains after it
    return PolicyVersion.objects.create(run=run, number=number, parent=best, step=run.step, path=str(target))
