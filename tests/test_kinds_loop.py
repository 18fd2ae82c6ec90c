"""Every domain kind through the real loop: tasks imported through the API, the verifier calibrated on a
real verify worker with known-good and known-bad completions of *the stored tasks*, then a short run of the
demo model (real Redis, real Celery workers, the torch engine) whose every verdict is a real judgment —
pass or fail, never ``invalid`` from a reference the verifier cannot read.

The workers are started once for the module; each kind gets its own domain, verifier and run.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from django.db.models import Count, Q

from tests.conftest import WorkerProcess, worker_env
from tests.test_domain_kinds import CASES, _Judge
from tests.test_pipeline import wait_status
from webapp.runs.loop.accounting import accounting
from webapp.runs.models import Evaluation, PromptGroup, Trajectory
from workers.domains import kinds

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# one case per kind, and json's schema mode as well
LOOP_CASES = [c for c in CASES if c[1] in ("exact_match", "python_tests", "command", "f1", "json_match", "llm_judge")]
SPEC = {"algorithm": {"learning_rate": 1e-3, "lora_rank": 8, "updates_per_batch": 1},
        "pipeline": {"group_size": 2, "batch_prompts": 2, "max_staleness": 1, "rollout_batch_prompts": 2},
        "sampling": {"temperature": 1.0, "max_tokens": 8}, "max_steps": 2, "eval_every": 2, "eval_tasks": 2}


@pytest.fixture(scope="module")
def workers(django_db_setup: Any, django_db_blocker: Any, redis_url: str, tmp_path_factory: Any) -> Iterator[None]:
    from workers.celery import app

    logs = tmp_path_factory.mktemp("kind-workers")
    with django_db_blocker.unblock():
        env = worker_env()
    app.control.purge()
    started = [WorkerProcess(queues, logs / f"{queues}.log", env) for queues in ("control", "rollout,train", "verify")]
    try:
        for worker in started:
            worker.wait_ready()
        yield
    finally:
        for worker in started:
            worker.stop()


@pytest.fixture(scope="module")
def judge_url() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def _rows(kind: str, row_ids: list[str], copies: int) -> list[dict[str, Any]]:
    """The kind's example rows, each repeated under new ids so a run has tasks to batch (the last copy of
    each is held out)."""
    base = [r for r in kinds.KINDS[kind].examples if r["id"] in row_ids]
    return [{**r, "id": f"{r['id']}-{i}", "split": "heldout" if i == copies - 1 else "train"}
            for i in range(copies) for r in base]


@pytest.mark.parametrize(("kind", "verifier_kind", "config", "row_ids", "completions"), LOOP_CASES,
                         ids=[f"{c[0]}-{c[2].get('mode', c[1])}" for c in LOOP_CASES])
def test_each_kind_calibrates_on_stored_tasks_and_trains_with_real_verdicts(
        workers: None, api: Any, judge_url: str, kind: str, verifier_kind: str, config: dict[str, Any],
        row_ids: list[str], completions: dict[str, tuple[list[str], list[str]]], tmp_path: Path) -> None:
    if verifier_kind == "llm_judge":
        config = {**config, "endpoint": judge_url, "model": "stand-in"}
    domain = api.post("/api/v1/domains/", {"name": f"{kind}-loop", "kind": kind}, format="json").json()
    body = "".join(json.dumps(r) + "\n" for r in _rows(kind, row_ids, copies=4)).encode()
    assert api.post(f"/api/v1/domains/{domain['id']}/import/", body,
                    content_type="application/x-ndjson").status_code == 201
    stored = {t["external_id"].rsplit("-", 1)[0]: t for t in
              api.get(f"/api/v1/domains/{domain['id']}/tasks/?page_size=100").json()["results"]}
    # calibration cases on the references the importer stored: known-good, known-bad, and two hacks
    cases = [{"prompt": stored[rid]["prompt"], "completion": c, "reference": stored[rid]["reference"],
              "expected": expected, "label": label}
             for rid, (good, bad) in completions.items()
             for expected, label, group in (("pass", "good", good), ("fail", "bad", bad)) for c in group]
    any_task = stored[row_ids[0]]
    cases += [{"prompt": any_task["prompt"], "completion": hack, "reference": any_task["reference"],
               "expected": "fail", "label": "hack"} for hack in ("", ":")]
    while sum(c["expected"] == "pass" for c in cases) < 2:
        cases.append(next(c for c in cases if c["expected"] == "pass"))
    verifier = api.post("/api/v1/verifiers/", {"name": f"{kind}-{verifier_kind}", "kind": verifier_kind,
                                               "config": config, "calibration_cases": cases}, format="json")
    assert verifier.status_code == 201, verifier.content
    vid = verifier.json()["id"]
    assert api.post(f"/api/v1/verifiers/{vid}/calibrate/", {}, format="json").status_code == 202
    deadline = time.monotonic() + 120
    while (v := api.get(f"/api/v1/verifiers/{vid}/").json())["calibration_status"] in ("running", "none"):
        assert time.monotonic() < deadline, "calibration did not finish"
        time.sleep(0.3)
    assert v["calibration_status"] == "passed", v["last_calibration"]
    assert api.patch(f"/api/v1/domains/{domain['id']}/", {"verifier": vid}, format="json").status_code == 200
    # the tool demo's model: the demo architecture with 128 positions, which every kind's rendered prompt fits
    # (the demo model's 64 do not: a longer prompt is refused)
    base = api.post("/api/v1/base-models/", {"name": f"demo-{kind}-{vid}", "path": "assets/base-models/demo-tool"},
                    format="json").json()
    run = api.post("/api/v1/runs/", {"name": f"{kind} loop", "base_model": base["id"],
                                     "domains": [{"domain": domain["id"]}], "spec": SPEC}, format="json")
    assert run.status_code == 201, run.content
    run_id = run.json()["id"]
    assert api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json").status_code == 200
    finished = wait_status(run_id, {"completed"}, timeout=180)
    assert finished.step == 2
    assert not accounting(finished).problems
    # the held-out evaluation at step 2 is scored on the verify queue after the run completed: wait for it
    deadline = time.monotonic() + 60
    while not Evaluation.objects.filter(version__run_id=run_id, version__number=2, status="done").exists():
        assert time.monotonic() < deadline, "the step-2 evaluation was not scored"
        time.sleep(0.3)
    # every sample of a trained group, and every evaluation sample, was judged (a group dropped when the run
    # completed may keep unjudged samples: those are pending, never invalid)
    trained = PromptGroup.objects.filter(run_id=run_id, status="trained").values("key")
    samples = Trajectory.objects.filter(run_id=run_id).filter(Q(group_key__in=trained) | Q(is_eval=True))
    verdicts = dict(samples.values_list("verdict").order_by().annotate(n=Count("id")))
    assert samples.filter(is_eval=False).count() == 2 * 2 * 2 and samples.filter(is_eval=True).exists()
    invalid = list(samples.filter(verdict="invalid").values_list("verdict_reason", flat=True)[:3])
    assert not invalid, f"{kind}: invalid verdicts {invalid} (all verdicts: {verdicts})"
    assert set(verdicts) <= {"pass", "fail"}, verdicts
    # the model was shown what the domain's template renders (the document, the input files, ...)
    shown = samples.filter(is_eval=False).values_list("prompt", flat=True).first()
    task_of = Trajectory.objects.filter(run_id=run_id, is_eval=False).select_related("task__domain").first()
    assert task_of is not None and shown == task_of.task.model_prompt()
