"""Failures end: a train step that raises every time fails its run, with the reason shown; its queued work
is revoked and nothing is left in flight (real Redis, real Celery workers, the torch engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_pipeline import SMALL, demo_run
from webapp.runs.models import PromptGroup, Run, RunEvent

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def wait_for(predicate, timeout: float, what: str):
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_a_train_step_that_always_raises_fails_the_run_with_its_reason(start_worker, api, user, tmp_path: Path):
    artifacts = tmp_path / "artifacts"
    start_worker("control", ARTIFACTS_ROOT=str(artifacts))
    start_worker("rollout,train", ARTIFACTS_ROOT=str(artifacts))
    start_worker("verify", ARTIFACTS_ROOT=str(artifacts))
    run_id = demo_run(user, api, {**SMALL, "max_steps": 5, "eval_every": 0})
    # A broken artifact store: where the run's versions go there is a file, so saving any version raises.
    (artifacts / "runs" / str(run_id)).mkdir(parents=True)
    (artifacts / "runs" / str(run_id) / "versions").write_text("not a directory")
    assert api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json").status_code == 200
    run = wait_for(lambda: (r := Run.objects.get(pk=run_id)).status == "failed" and r, 180, "the run to fail")
    assert run.step == 0
    assert "train_step failed 3 times the same way" in run.status_reason
    assert "NotADirectoryError" in run.status_reason or "FileExistsError" in run.status_reason, run.status_reason
    failures = list(RunEvent.objects.filter(run_id=run_id, kind="task.failed").order_by("id"))
    assert [e.data["count"] for e in failures] == [1, 2, 3]
    assert all(e.data["task"] == "workers.tasks.train.train_step" for e in failures)
    # the API and the page say why
    body = api.get(f"/api/v1/runs/{run_id}/").json()
    assert body["status"] == "failed" and body["status_reason"] == run.status_reason
    events = api.get(f"/api/v1/runs/{run_id}/events/").json()
    rows = events["results"] if isinstance(events, dict) else events
    assert any(e["kind"] == "status.failed" and "train_step failed" in e["message"] for e in rows)
    from django.test import Client

    client = Client()
    client.force_login(user)
    assert run.status_reason[:60] in client.get(f"/runs/{run_id}/").content.decode()
    # nothing is left in flight: every group was dropped with the reason
    wait_for(lambda: not PromptGroup.objects.filter(run_id=run_id).exclude(status="dropped").exists(), 30,
             "the failed run's groups to be dropped")
    assert not PromptGroup.objects.filter(run_id=run_id, drop_reason="").exists()


def test_a_prompt_longer_than_the_model_s_context_is_refused_with_the_reason(start_worker, api, user):
    """The demo model has 64 positions: a longer prompt's group is dropped with the reason (not sampled past
    the context, not padding its whole batch to its length), and a held-out task with one counts as invalid
    with the reason, not as a failure; the short prompts around them train and evaluate as usual."""
    import json

    from tests import factories
    from tests.test_pipeline import wait_status
    from webapp.catalog.models import BaseModel, TaskDomain
    from webapp.catalog.services import do_import_tasks
    from webapp.runs.models import Evaluation, Trajectory

    start_worker("control")
    start_worker("rollout,train")
    start_worker("verify")
    domain = TaskDomain.objects.create(owner=user, name="mixed", kind="answer",
                                       verifier=factories.verifier(user, name="exact"))
    long = "Think about this carefully before you answer: " * 2
    rows = []
    for i in range(24):  # admitted in id order: every other train task is too long
        a, b = 10 + i, 20 + i
        rows.append({"prompt": f"{long if i % 2 else ''}{a}+{b}=", "answer": a + b, "split": "train"})
    for i in range(6):
        a, b = 40 + i, 50 + i
        rows.append({"prompt": f"{long if i < 2 else ''}{a}+{b}=", "answer": a + b, "split": "heldout"})
    do_import_tasks(domain, (json.dumps(r) for r in rows))
    bm = BaseModel.objects.create(owner=user, name="demo", path="assets/base-models/demo")
    spec = {**SMALL, "max_steps": 2, "eval_every": 2, "eval_tasks": 6}
    response = api.post("/api/v1/runs/", {"name": "long", "base_model": bm.pk, "domains": [{"domain": domain.pk}],
                                          "spec": spec}, format="json")
    run_id = response.json()["id"]
    assert api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json").status_code == 200
    run = wait_status(run_id, {"completed"}, timeout=240)
    groups = list(PromptGroup.objects.filter(run=run).select_related("task"))
    refused = [g for g in groups if "tokens: the model's context of 64 leaves no room" in g.drop_reason]
    assert refused and all(g.status == "dropped" and long in g.task.prompt for g in refused)
    # no long prompt was sampled or trained (one still admitted when the run completed is dropped with the
    # run's reason instead)
    assert all(g.status == "dropped" for g in groups if long in g.task.prompt)
    assert not Trajectory.objects.filter(run=run, is_eval=False, prompt__contains=long).exists()
    assert PromptGroup.objects.filter(run=run, status="trained").count() == 2 * SMALL["pipeline"]["batch_prompts"]
    evaluation = wait_for(lambda: Evaluation.objects.filter(version__run=run, version__number=0, status="done").first(),
                          60, "the base model's evaluation")
    assert evaluation.invalid_count == 2 and evaluation.n_tasks == 6 and len(evaluation.results["tasks"]) == 4
    invalid = Trajectory.objects.filter(run=run, is_eval=True, verdict="invalid", version=0)
    assert invalid.count() == 2 and all("leaves no room" in t.verdict_reason for t in invalid)
