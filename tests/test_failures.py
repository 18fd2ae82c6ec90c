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
