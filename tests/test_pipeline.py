"""The generate → verify → train loop end to end: real Redis, real Celery workers, the torch engine.

Each test drives a small run of the demo model through the API and checks the database afterwards:
versions, verdicts, metrics, and that every admitted prompt group was trained exactly once or dropped
with a reason.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from django.db.models import Count

from tests import factories
from webapp.catalog.models import BaseModel, TaskDomain
from webapp.catalog.services import do_import_tasks
from webapp.runs.loop import tick
from webapp.runs.loop.accounting import accounting
from webapp.runs.models import Evaluation, MetricPoint, PolicyVersion, PromptGroup, Run, Trajectory

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SMALL = {
    "algorithm": {"learning_rate": 1e-3, "lora_rank": 8, "updates_per_batch": 1},
    "pipeline": {"group_size": 4, "batch_prompts": 4, "max_staleness": 1, "rollout_batch_prompts": 4},
    "sampling": {"temperature": 1.0, "max_tokens": 5, "stop": ["\n"]},
    "max_steps": 3, "eval_every": 3, "eval_tasks": 20,
}


@pytest.fixture
def loop_workers(start_worker):
    start_worker("control")
    start_worker("rollout,train")
    start_worker("verify")


def demo_run(user, api, spec=SMALL) -> int:
    from workers.policy.demo_model import _split_pool

    verifier = factories.verifier(user, name="exact-demo")
    domain = TaskDomain.objects.create(owner=user, name="addition", kind="answer", verifier=verifier)
    rows = [{"prompt": p, "answer": a, "split": s} for s in ("train", "heldout") for p, a in _split_pool("addition", s)[:40]]
    do_import_tasks(domain, (json.dumps(r) for r in rows))
    bm = BaseModel.objects.create(owner=user, name="demo", path="assets/base-models/demo")
    response = api.post("/api/v1/runs/", {"name": "loop", "base_model": bm.pk, "domains": [{"domain": domain.pk}],
                                          "spec": spec}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def assert_counts_add_up(run: Run) -> None:
    """Every admitted group trained exactly once or dropped with a reason; versions 1..step."""
    report = accounting(run)
    assert not report.problems, report.problems
    assert set(report.by_status) <= {"trained", "dropped"}, report.by_status
    assert report.by_status["trained"] == run.step * run.spec["pipeline"]["batch_prompts"]
    assert report.admitted == report.by_status["trained"] + report.by_status.get("dropped", 0)
    assert list(PolicyVersion.objects.filter(run=run, number__gt=0).values_list("number", flat=True)) == list(
        range(1, run.step + 1))


def wait_status(run_id: int, wanted: set[str], timeout: float = 240) -> Run:
    deadline = time.monotonic() + timeout
    while True:
        run = Run.objects.get(pk=run_id)
        if run.status in wanted:
            return run
        assert run.status != "failed", run.status_reason
        assert time.monotonic() < deadline, f"run still {run.status} at step {run.step}"
        time.sleep(0.5)


def test_a_short_run_completes_and_the_counts_add_up(loop_workers, api, user):
    run_id = demo_run(user, api)
    assert api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json").status_code == 200
    run = wait_status(run_id, {"completed"})
    assert run.step == 3 and run.latest_version == 3
    assert list(PolicyVersion.objects.filter(run=run).values_list("number", flat=True)) == [0, 1, 2, 3]  # 0: base
    groups = dict(PromptGroup.objects.filter(run=run).values_list("status").annotate(n=Count("id")))
    assert groups.get("trained") == 12  # 3 steps x B=4
    for group in PromptGroup.objects.filter(run=run, status="dropped"):
        assert group.drop_reason
    trained = Trajectory.objects.filter(run=run, trained_step__isnull=False)
    assert trained.count() == 12 * 4
    assert not trained.filter(verdict="pending").exists()
    assert set(trained.values_list("verdict", flat=True)) <= {"pass", "fail", "invalid"}
    # every trained sample was at most max_staleness versions old when it was trained
    for t in trained:
        assert t.trained_step - 1 - t.version <= 1
    # advantages were computed where the batch was assembled and stored with each sample; a sample the
    # trainer learnt from says whether it was clipped (groups without signal have advantage 0, clipped None)
    from workers.policy.losses import sample_advantages

    for key in set(trained.values_list("group_key", flat=True)):
        rows = list(trained.filter(group_key=key).order_by("sample_index"))
        want = sample_advantages([None if t.verdict == "invalid" else t.reward for t in rows], "grpo")
        assert [t.advantage for t in rows] == pytest.approx(want)
        if not any(want):  # no learning signal: the trainer skipped the group, so nothing was clipped or not
            assert all(t.clipped is None for t in rows)
    learnt = trained.exclude(advantage=0.0).exclude(advantage__isnull=True)
    assert learnt.exists() and not learnt.filter(clipped__isnull=True).exists()
    names = set(MetricPoint.objects.filter(run=run).values_list("name", flat=True))
    assert {"loss", "reward", "heldout_reward", "tokens_per_s", "trajectories_per_s", "staleness_mean", "kl_ref",
            "groups_used", "iw_min"} <= names
    seqs = list(MetricPoint.objects.filter(run=run).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, len(seqs) + 1))
    kinds = list(run.events.values_list("kind", flat=True))
    assert kinds[:3] == ["created", "status.queued", "status.running"] and kinds[-1] == "status.completed"
    assert_counts_add_up(run)
    # the base model (version 0) was evaluated on the held-out tasks, scored per task on the verify queue
    evaluations = Evaluation.objects.filter(version__run=run, version__number__in=[0, 3], status="done")
    deadline = time.monotonic() + 60
    while evaluations.count() < 2:
        assert time.monotonic() < deadline, list(Evaluation.objects.values_list("version__number", "status"))
        time.sleep(0.3)
    for evaluation in evaluations:
        assert evaluation.n_tasks == 20 and evaluation.results["greedy"] and len(evaluation.results["tasks"]) == 20
        assert evaluation.score == sum(s for _, s in evaluation.results["tasks"]) / 20
    assert Trajectory.objects.filter(run=run, is_eval=True, verdict="pending").count() == 0


def test_a_large_evaluation_takes_turns_with_training(loop_workers, api, user):
    """Version 0's evaluation of 2 domains x 100 held-out tasks runs in chunks of 64 sequences
    (``pipeline.eval_chunk``),
    each queued behind the waiting generation: training rows are written between its chunks, not after
    all of it, and every task is still scored once, per domain."""
    from workers.policy.demo_tasks import _split_pool

    verifier = factories.verifier(user, name="exact-chunks")
    domains = []
    for name in ("addition", "multiplication"):
        domain = TaskDomain.objects.create(owner=user, name=name, kind="answer", verifier=verifier)
        rows = [{"prompt": p, "answer": a, "split": s} for s in ("train", "heldout")
                for p, a in _split_pool(name, s)[:100]]
        do_import_tasks(domain, (json.dumps(r) for r in rows))
        domains.append(domain)
    bm = BaseModel.objects.create(owner=user, name="demo", path="assets/base-models/demo")
    spec = {**SMALL, "pipeline": {**SMALL["pipeline"], "eval_chunk": 64}, "max_steps": 4, "eval_every": 0,
            "eval_tasks": 100}
    response = api.post("/api/v1/runs/", {"name": "chunks", "base_model": bm.pk,
                                          "domains": [{"domain": d.pk} for d in domains], "spec": spec}, format="json")
    assert response.status_code == 201, response.content
    run_id = response.json()["id"]
    assert api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json").status_code == 200
    wait_status(run_id, {"completed"})
    evaluations = Evaluation.objects.filter(version__run_id=run_id, version__number=0, status="done")
    deadline = time.monotonic() + 120
    while evaluations.count() < 2:
        assert time.monotonic() < deadline, list(Evaluation.objects.values_list("domain__name", "status"))
        time.sleep(0.3)
    for evaluation in evaluations:
        assert evaluation.n_tasks == 100 and len(evaluation.results["tasks"]) == 100
    v0 = Trajectory.objects.filter(run_id=run_id, is_eval=True, version=0)
    assert v0.count() == 200 and not v0.filter(verdict="pending").exists()
    ids = list(v0.order_by("id").values_list("id", flat=True))
    between = Trajectory.objects.filter(run_id=run_id, is_eval=False, id__gt=ids[0], id__lt=ids[-1])
    assert between.exists(), "the evaluation held the device until it was done"
    # pass@2 of the same version: chunks of 32 tasks, each sent the evaluation's k
    v0_id = PolicyVersion.objects.get(run_id=run_id, number=0).pk
    response = api.post(f"/api/v1/policy-versions/{v0_id}/evaluate/", {"samples": 2}, format="json")
    assert response.status_code in (200, 202), response.content
    deadline = time.monotonic() + 180
    while Evaluation.objects.filter(version_id=v0_id, status="done", n_samples=2).count() < 2:
        assert time.monotonic() < deadline, list(Evaluation.objects.values_list("domain__name", "status", "n_samples"))
        time.sleep(0.3)
    for evaluation in Evaluation.objects.filter(version_id=v0_id):
        assert evaluation.n_tasks == 100 and len(evaluation.results["tasks"]) == 100 and not evaluation.results["greedy"]
    assert Trajectory.objects.filter(run_id=run_id, is_eval=True, group_key__startswith="eval-v0-k2-").count() == 400


def test_only_a_large_evaluation_is_chunked():
    """Up to 1,024 sequences an evaluation is one batch, as it always was; beyond that, chunks of one
    generation task's sequences; a run's ``pipeline.eval_chunk`` sets the size whatever the total."""
    from webapp.runs.loop.heldout import chunk_tasks
    from workers.pipeline.spec import RunSpec

    spec = RunSpec.model_validate(SMALL)  # rollout 4 prompts x G 4 = 16 sequences: the 64 floor
    assert chunk_tasks(spec, 1, 1024) == 1024 and chunk_tasks(spec, 4, 256) == 256
    assert chunk_tasks(spec, 1, 3900) == 64 and chunk_tasks(spec, 2, 600) == 32
    assert chunk_tasks(spec, 64, 100) == 8  # pass@64: at least 8 tasks a chunk
    chunked = RunSpec.model_validate({**SMALL, "pipeline": {**SMALL["pipeline"], "eval_chunk": 100}})
    assert chunk_tasks(chunked, 1, 50) == 100 and chunk_tasks(chunked, 4, 50) == 25
    assert chunk_tasks(chunked, 200, 50) == 1


def test_an_evaluation_chunk_delivered_twice_sends_its_successor_once(redis_url):
    """A chunk's worker may die after queueing the next chunk and before the ack: the redelivered chunk
    samples again (its rows are idempotent) but must not fork the chain (real Redis)."""
    import uuid

    from webapp.runs.loop.heldout import _claim

    chain = uuid.uuid4().hex
    assert _claim(chain, "64") and not _claim(chain, "64")
    assert _claim(chain, "128") and _claim(uuid.uuid4().hex, "64")  # another step, another evaluation


def test_a_periodic_evaluation_is_skipped_while_a_chunked_one_is_sampling(redis_url, user):
    """Chunks take turns with training, so a pack's evaluation can outlast ``eval_every`` steps: the
    evaluation then due is skipped, with an event saying which one is still sampling, instead of a second
    chain (and a third...) until evaluation held the device again (real Redis)."""
    from webapp.runs.loop import heldout, reporting
    from webapp.runs.models import RunEvent

    run = factories.run(user)
    Run.objects.filter(pk=run.pk).update(spec={**run.spec, "eval_every": 5}, status="running")
    assert heldout.sampling_now(run.pk) is None
    heldout._mark_sampling(run.pk, "chain-a", 10, 64, 3850)
    heldout._mark_sampling(run.pk, "chain-b", 0, 1216, 3850)
    assert heldout.sampling_now(run.pk) == (0, 1216, 3850)  # the oldest version, not the first string
    PolicyVersion.objects.create(run=run, number=15, step=15, metrics={})
    assert reporting.report_step(run.pk, 15) > 0
    skipped = RunEvent.objects.get(run=run, kind="evaluation.skipped")
    assert skipped.message == "evaluation of v15 skipped: v0's is still sampling (1216 of 3850 tasks)"
    heldout._mark_sampled(run.pk, "chain-b")
    heldout._mark_sampled(run.pk, "chain-a")
    assert heldout.sampling_now(run.pk) is None  # the next due evaluation is sent


def test_pause_keeps_work_and_resume_continues(loop_workers, api, user):
    spec = {**SMALL, "max_steps": 40}
    run_id = demo_run(user, api, spec)
    api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json")
    deadline = time.monotonic() + 120
    while Run.objects.get(pk=run_id).step < 1:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    # the control worker may finish the pause before the response re-reads the run
    assert api.post(f"/api/v1/runs/{run_id}/pause/", {}, format="json").json()["status"] in ("pausing", "paused")
    paused = wait_status(run_id, {"paused"})
    counts = dict(PromptGroup.objects.filter(run=paused).values_list("status").annotate(n=Count("id")))
    assert not set(counts) & {"admitted", "generating", "verifying", "training"}, counts  # nothing in flight
    time.sleep(2)
    assert Run.objects.get(pk=run_id).step == paused.step  # nothing moves while paused
    assert api.post(f"/api/v1/runs/{run_id}/resume/", {}, format="json").status_code == 200
    deadline = time.monotonic() + 120
    while Run.objects.get(pk=run_id).step <= paused.step:
        assert time.monotonic() < deadline, "resumed run did not train"
        time.sleep(0.3)
    assert api.post(f"/api/v1/runs/{run_id}/cancel/", {}, format="json").status_code == 200
    wait_status(run_id, {"cancelled"})
    # the control worker drops what a cancelled run still had in flight, with the reason
    leftover = PromptGroup.objects.filter(run_id=run_id).exclude(status__in=["trained", "dropped"])
    deadline = time.monotonic() + 30
    while leftover.exists():
        assert time.monotonic() < deadline, list(leftover.values_list("status", flat=True))
        time.sleep(0.5)
    assert not PromptGroup.objects.filter(run_id=run_id, status="dropped", drop_reason="").exists()


def test_a_worker_killed_mid_step_loses_nothing(start_worker, api, user):
    """SIGKILL the rollout/train worker while it holds work; a new worker and the recovery tick finish the run."""
    fast = {"TEMPER_KICK_SECONDS": "1", "TEMPER_STALL_SECONDS": "4"}
    start_worker("control", beat=True, **fast)
    start_worker("verify")
    gpu = start_worker("rollout,train")
    run_id = demo_run(user, api, {**SMALL, "max_steps": 4})
    api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json")
    deadline = time.monotonic() + 120
    while True:  # wait until the GPU worker holds work: a generation claimed, or a train step claimed
        run = Run.objects.get(pk=run_id)
        busy = PromptGroup.objects.filter(run_id=run_id, status__in=["generating", "training"]).exists()
        if run.step >= 1 and busy:
            break
        assert time.monotonic() < deadline, "the GPU worker never got busy"
        time.sleep(0.05)
    gpu.kill()
    start_worker("rollout,train")
    run = wait_status(run_id, {"completed"}, timeout=300)
    assert run.step == 4
    assert_counts_add_up(run)
    for group in PromptGroup.objects.filter(run=run, status="trained"):
        # exactly G samples, each trained once, in the step that claimed the group
        samples = Trajectory.objects.filter(run=run, group_key=group.key)
        assert sorted(samples.values_list("sample_index", flat=True)) == list(range(4))
        assert set(samples.values_list("trained_step", flat=True)) == {group.trained_step}


def test_cancel_revokes_queued_work(start_worker, api, user):
    """Generation queued with no rollout consumer yet: cancelling revokes it, so the worker that later
    consumes the queue discards the messages instead of running them."""
    from workers.celery import app

    start_worker("control")
    start_worker("verify")
    gpu = start_worker("train")  # consumes rollout only once told to, after the cancel
    run_id = demo_run(user, api, {**SMALL, "max_steps": 10})
    api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json")
    deadline = time.monotonic() + 60
    while not PromptGroup.objects.filter(run_id=run_id, status="admitted").exists():
        assert time.monotonic() < deadline, "nothing was admitted"
        time.sleep(0.1)
    queued = tick.queued_ids(Run.objects.get(pk=run_id))
    assert queued and all(t.startswith("generate-") for t in queued)
    assert api.post(f"/api/v1/runs/{run_id}/cancel/", {}, format="json").json()["status"] == "cancelled"
    deadline = time.monotonic() + 30
    while PromptGroup.objects.filter(run_id=run_id).exclude(status="dropped").exists():
        assert time.monotonic() < deadline, "the control worker did not drop the cancelled run's groups"
        time.sleep(0.1)
    time.sleep(0.5)  # the revoke broadcast goes out right after the drop commits
    app.control.add_consumer("rollout", destination=[f"test-{os.getpid()}-train@{socket.gethostname()}"],
                             reply=True, timeout=10)
    deadline = time.monotonic() + 30
    while any(app.AsyncResult(t).state != "REVOKED" for t in queued):
        assert time.monotonic() < deadline, [app.AsyncResult(t).state for t in queued]
        time.sleep(0.2)
    assert not Trajectory.objects.filter(run_id=run_id).exists()
    assert set(PromptGroup.objects.filter(run_id=run_id).values_list("drop_reason", flat=True)) == {
        "run cancelled before it was trained"}
    assert gpu.proc.poll() is None
