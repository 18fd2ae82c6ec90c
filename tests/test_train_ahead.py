"""Training ahead (``webapp.runs.loop.training.plan_ahead``): on an on-policy run whose verdicts the device
gives as it generates, each train step is queued on the device right behind its own rollout, before the
rows are written and the scheduler has claimed it. It must learn exactly as the step trained the usual way,
be given up without a trace when the scheduler decides otherwise, and lose nothing when the device process
dies under it. Real Redis, real Celery workers, a real device process, the torch engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests import factories
from tests.test_pipeline import assert_counts_add_up, wait_status
from webapp.catalog.models import BaseModel, TaskDomain
from webapp.catalog.services import do_import_tasks
from webapp.runs import services
from webapp.runs.loop import generation, tick, training
from webapp.runs.models import PolicyVersion, PromptGroup, Run, Trajectory
from workers.pipeline.spec import RunSpec

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ON_POLICY = {
    "algorithm": {"learning_rate": 1e-4, "lora_rank": 0, "updates_per_batch": 2, "micro_batch_size": 64},
    "pipeline": {"mode": "async", "group_size": 4, "batch_prompts": 4, "max_staleness": 0, "rollout_batch_prompts": 4},
    "sampling": {"temperature": 1.0, "max_tokens": 5, "stop": ["\n"]},
    "max_steps": 5, "eval_every": 0, "eval_tasks": 8,
}


@pytest.fixture
def domain(user) -> TaskDomain:
    from workers.policy.demo_model import _split_pool

    verifier = factories.verifier(user, name="exact-demo")
    domain = TaskDomain.objects.create(owner=user, name="addition", kind="answer", verifier=verifier)
    rows = [{"prompt": p, "answer": a, "split": s} for s in ("train", "heldout")
            for p, a in _split_pool("addition", s)[:40]]
    do_import_tasks(domain, (json.dumps(r) for r in rows))
    return domain


def create_run(api, user, domain: TaskDomain, name: str, spec: dict = ON_POLICY) -> int:
    bm, _ = BaseModel.objects.get_or_create(owner=user, name="demo", defaults={"path": "assets/base-models/demo"})
    response = api.post("/api/v1/runs/", {"name": name, "base_model": bm.pk, "domains": [{"domain": domain.pk}],
                                          "spec": spec}, format="json")
    assert response.status_code == 201, response.content
    return int(response.json()["id"])


def version_weights(run: Run) -> list[str]:
    return [hashlib.sha256((Path(v.path) / "model.safetensors").read_bytes()).hexdigest()
            for v in PolicyVersion.objects.filter(run=run, number__gt=0).order_by("number")]


def test_an_on_policy_run_trains_each_step_ahead_and_learns_exactly_as_in_one_process(start_worker, api, user,
                                                                                     domain):
    start_worker("control")
    start_worker("verify")
    ahead_worker = start_worker("rollout,train")  # its device process trains ahead
    first = create_run(api, user, domain, "ahead")
    api.post(f"/api/v1/runs/{first}/start/", {}, format="json")
    ahead = wait_status(first, {"completed"})
    ahead_worker.stop()
    start_worker("rollout,train", TEMPER_DEVICE_PROCESS="0")  # the same work in the worker, step by step
    second = create_run(api, user, domain, "in one process")
    api.post(f"/api/v1/runs/{second}/start/", {}, format="json")
    usual = wait_status(second, {"completed"})
    for run in (ahead, usual):
        assert run.step == 5
        assert_counts_add_up(run)
    trained_ahead = {r: [v.metrics.get("trained_ahead") for v in PolicyVersion.objects.filter(run=r, number__gt=0)]
                     for r in (ahead, usual)}
    assert trained_ahead == {ahead: [True] * 5, usual: [False] * 5}
    # the same samples, verdicts and advantages, and every version the same weights, bit for bit
    fields = ("completion_token_ids", "behaviour_logprobs", "verdict", "reward", "advantage", "clipped", "version",
              "trained_step")

    def samples(run: Run) -> list[tuple]:
        return list(Trajectory.objects.filter(run=run, is_eval=False).order_by("id").values_list(*fields))

    assert samples(ahead) == samples(usual)
    assert version_weights(ahead) == version_weights(usual)


def test_a_step_trained_ahead_is_given_up_when_the_scheduler_decides_otherwise(api, user, domain, redis_url):
    """The run is paused while its step trains ahead: the tick claims nothing, so the step is not recorded and
    the trainer it moved on is dropped. Resumed, the step trained the usual way from the base model makes the
    very same version (the given-up step left no trace in the trainer)."""
    from workers.policy import device_process, resident

    run_id = create_run(api, user, domain, "given up")
    services.do_start_run(Run.objects.get(pk=run_id), actor=user)
    tick.advance(run_id)  # running: four prompts admitted
    client = device_process.DeviceClient()
    client.start()
    resident.use_remote(client)
    try:
        run = Run.objects.select_related("base_model").get(pk=run_id)
        spec = RunSpec.model_validate(run.spec)
        groups = generation.claim(list(PromptGroup.objects.filter(run=run).values_list("pk", flat=True)), "test@here")
        ahead = training.plan_ahead(run, spec, groups, None)
        assert ahead is not None and ahead.step == 1 and ahead.base == (run_id, 0, None)
        engine = generation.load_engine(run, spec)
        prompts = [g.domain.render_messages(g.task.prompt, g.task.reference, g.task.metadata) for g in groups]
        future = resident.rollout_async(engine, prompts, generation.sampling(spec, 4), serve=ahead.base,
                                        judges=[generation.inline_judge(g) for g in groups], keep=ahead.token)
        training.queue_ahead(run, spec, ahead)
        out = resident.wait(future)
        rows = [generation.SampleRow(group_id=groups[n // 4].pk, index=n % 4, prompt="", completion=s.text,
                                     prompt_token_ids=s.prompt_token_ids, completion_token_ids=s.completion_token_ids,
                                     logprobs=s.logprobs, finish_reason=s.finish_reason, version=s.version)
                 for n, s in enumerate(out.samples)]
        assert out.judged is not None
        judged = {groups[i].pk: j for i, j in enumerate(out.judged) if j is not None}
        ahead.enter()
        generation.write_samples(run_id, {g.pk: g for g in groups}, rows, judged=judged)
        services.do_pause_run(Run.objects.get(pk=run_id), actor=user)
        claimed = tick.advance_holding_train(run_id, "test@here")
        assert claimed is None and Run.objects.get(pk=run_id).status == "paused"
        assert training.conclude_ahead(run_id, ahead, claimed, True, "test@here") is None
        given_up = hashlib.sha256((ahead.out / "model.safetensors").read_bytes()).hexdigest()
        assert not PolicyVersion.objects.filter(run_id=run_id, number=1).exists()
        assert Run.objects.get(pk=run_id).state.get("train_claim") is None
        assert client.snapshot()["trainers"] == []  # dropped: it was a step ahead of the run
        assert set(PromptGroup.objects.filter(run_id=run_id).values_list("status", flat=True)) == {"ready"}
        # resumed: the scheduler claims the step, and it is trained the usual way
        services.do_resume_run(Run.objects.get(pk=run_id), actor=user)
        tick.advance(run_id)
        step = Run.objects.get(pk=run_id).state["train_claim"]
        assert training.run_step(run_id, step, "test@here") == 1
        version = PolicyVersion.objects.get(run_id=run_id, number=1)
        assert version.metrics["trained_ahead"] is False
        assert hashlib.sha256((Path(version.path) / "model.safetensors").read_bytes()).hexdigest() == given_up
    finally:
        resident.use_remote(None)
        client.close()


def test_a_device_process_killed_mid_run_loses_nothing(start_worker, api, user, domain):
    """SIGKILL the GPU worker's device process while it trains: the requests in flight fail, their work is
    handed out again (a generation released, a claimed step sent to the train queue), a new device process
    starts, and the run completes with every group trained exactly once."""
    start_worker("control", TEMPER_KICK_SECONDS="1", TEMPER_STALL_SECONDS="4")
    start_worker("verify")
    gpu = start_worker("rollout,train")
    run_id = create_run(api, user, domain, "killed", {**ON_POLICY, "max_steps": 8})
    api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json")
    deadline = time.monotonic() + 120
    while Run.objects.get(pk=run_id).step < 2:
        assert time.monotonic() < deadline, "the run never reached step 2"
        time.sleep(0.05)
    child = device_child(gpu.proc.pid)
    os.kill(child, signal.SIGKILL)
    run = wait_status(run_id, {"completed"}, timeout=300)
    assert run.step == 8
    assert_counts_add_up(run)
    assert device_child(gpu.proc.pid) != child
    for group in PromptGroup.objects.filter(run=run, status="trained"):
        samples = Trajectory.objects.filter(run=run, group_key=group.key)
        assert sorted(samples.values_list("sample_index", flat=True)) == list(range(4))
        assert set(samples.values_list("trained_step", flat=True)) == {group.trained_step}


def device_child(worker_pid: int) -> int:
    """The pid of the worker's device process."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == worker_pid and b"workers.policy.device_process" in cmdline:
            return int(entry.name)
    raise AssertionError(f"worker {worker_pid} has no device process")


def rollout_behind_a_step_given_up(run_id: int, group_ids: list[int], version_dir: Path, monkeypatch) -> list[int]:
    """``generation.generate`` on a thread of its own (as a GPU worker's second task) while this thread holds
    the run's train step, confirmed with version 1 in ``version_dir``; once the rollout has asked the device
    for it, the step is left without ``ok`` (given up). ``generate``'s result, as a list."""
    from workers.policy import resident

    tried = threading.Event()
    real_rollout = resident.rollout

    def rollout_then_signal(*args, **kwargs):
        try:
            return real_rollout(*args, **kwargs)
        finally:
            tried.set()  # it sampled (or failed to switch to) the confirmed version

    def rollout() -> None:
        from django.db import connection

        try:
            out.append(generation.generate(run_id, group_ids, "test@here"))
        finally:
            connection.close()  # this thread's own

    monkeypatch.setattr(resident, "rollout", rollout_then_signal)
    out: list[int] = []
    with resident.training(run_id) as step:
        assert step is not None
        step.confirm(1, 1, version_dir)
        worker = threading.Thread(target=rollout)
        worker.start()
        assert tried.wait(120)
    worker.join(120)
    monkeypatch.setattr(resident, "rollout", real_rollout)
    return out


def test_samples_of_a_confirmed_step_that_is_given_up_are_not_written(api, user, domain, redis_url, tmp_path,
                                                                      monkeypatch):
    """A step trained ahead is confirmed before it is recorded, so the run's next rollout samples from its
    version meanwhile. If the step is then given up (its record failed), those samples are of no recorded
    version: none is written, and the groups go back to be generated again."""
    from tests.policy.conftest import DEMO_DIR, make_lora_version

    run_id = create_run(api, user, domain, "confirmed, then given up")
    services.do_start_run(Run.objects.get(pk=run_id), actor=user)
    tick.advance(run_id)  # running: four prompts admitted
    group_ids = list(PromptGroup.objects.filter(run_id=run_id).values_list("pk", flat=True))
    v1 = make_lora_version(DEMO_DIR, tmp_path / "v1", version=1, seed=1)
    # confirmed as conclude_ahead does before it records, then given up
    assert rollout_behind_a_step_given_up(run_id, group_ids, v1, monkeypatch) == [0]
    assert not Trajectory.objects.filter(run_id=run_id).exists()
    groups = PromptGroup.objects.filter(pk__in=group_ids)
    assert {(g.status, g.attempt, g.holder) for g in groups} == {("admitted", 1, "")}


ASYNC = {**ON_POLICY, "pipeline": {**ON_POLICY["pipeline"], "max_staleness": 2}}
"""Async with room for staleness: prompts are admitted ahead of the step that trains."""


def generate_admitted(run_id: int) -> None:
    """Admit what the scheduler lets in and generate it here (the exact-match verifier judges as it samples:
    the groups are ready at once)."""
    tick.advance(run_id)
    admitted = list(PromptGroup.objects.filter(run_id=run_id, status="admitted").values_list("pk", flat=True))
    assert admitted
    assert generation.generate(run_id, admitted, "test@here") > 0


def test_a_worker_shutting_down_sends_the_step_it_claimed_to_the_train_queue(api, user, domain, redis_url,
                                                                              monkeypatch):
    """A chain of steps stops with the worker: the step its last record claimed goes to the train queue (held
    by nobody's task, it would wait for the worker to be known gone)."""
    from workers import messages

    run_id = create_run(api, user, domain, "stopping", ASYNC)
    services.do_start_run(Run.objects.get(pk=run_id), actor=user)
    generate_admitted(run_id)
    generate_admitted(run_id)
    assert PromptGroup.objects.filter(run_id=run_id, status="ready").count() >= 8
    sent: list[tuple] = []
    monkeypatch.setattr(messages, "train_step", lambda *args, **kw: sent.append(args))
    assert training.run_step(run_id, 1, "test@here", go_on=lambda: False) == 1
    run = Run.objects.get(pk=run_id)
    assert run.step == 1 and run.state["train_claim"] == 2 and run.state["train_holder"] == "test@here"
    assert sent == [(run_id, 2)]


def test_only_the_call_that_records_a_step_runs_its_callbacks(api, user, domain, redis_url):
    """``finish``'s ``on_recorded`` (what lets a rollout write samples of the version) and ``then`` (the next
    decision) run for the call that records the step, not for a duplicate delivery's, whose copy of the
    version's files is not the one recorded."""
    run_id = create_run(api, user, domain, "recorded once", ASYNC)
    run = Run.objects.get(pk=run_id)
    calls: list[str] = []
    for who in ("first", "duplicate"):
        version = training.finish(run, 1, [], version_path=Path("/nowhere"), metrics={}, finished_at=time.time(),
                                  on_recorded=lambda who=who: calls.append(f"{who} recorded"),
                                  then=lambda who=who: calls.append(f"{who} decided"))
        assert version.number == 1
    assert calls == ["first decided", "first recorded"]


def test_a_step_is_confirmed_as_it_is_queued_and_the_next_ready_batch_is_trained_in_the_same_task(
        api, user, domain, redis_url, monkeypatch):
    """With a device process, a train step's version may be asked for as soon as the step is queued on the
    device (the next rollout queues right behind it, instead of waiting for its result and record); and the
    decision taken as it is recorded claims the next step, with its batch ready, for this very task, which
    trains it at once: no train message, no second task."""
    from workers import messages
    from workers.policy import device_process, resident

    run_id = create_run(api, user, domain, "chained", ASYNC)
    services.do_start_run(Run.objects.get(pk=run_id), actor=user)
    generate_admitted(run_id)  # batch 1, ready: the tick after it claims step 1
    generate_admitted(run_id)  # batch 2, ready
    assert Run.objects.get(pk=run_id).state["train_claim"] == 1
    batches = PromptGroup.objects.filter(run_id=run_id, status="ready").count() // 4
    assert batches >= 2
    sent: list[tuple] = []
    monkeypatch.setattr(messages, "train_step", lambda *args, **kw: sent.append(args))
    seen: list[tuple] = []
    real_wait = resident.wait

    def wait_noting_confirmed(future):
        step = resident.after_training(run_id, timeout=0)
        seen.append((step.step, step.version[0]) if step is not None and step.version else None)
        return real_wait(future)

    monkeypatch.setattr(resident, "wait", wait_noting_confirmed)
    client = device_process.DeviceClient()
    client.start()
    resident.use_remote(client)
    try:
        assert training.run_step(run_id, 1, "test@here") == 1
    finally:
        resident.use_remote(None)
        client.close()
    run = Run.objects.get(pk=run_id)
    assert run.step == batches and run.latest_version == batches
    assert sent == []  # the steps after the first went nowhere: this task trained them
    assert seen == [(n, n) for n in range(1, batches + 1)]  # each confirmed before its result was awaited
    assert set(PromptGroup.objects.filter(run_id=run_id, trained_step__isnull=False)
               .values_list("status", "trained_step")) == {("trained", n) for n in range(1, batches + 1)}
    assert "train_claim" not in run.state


def test_a_rollout_queued_behind_a_confirmed_step_that_fails_is_generated_again(api, user, domain, redis_url,
                                                                                 tmp_path, monkeypatch):
    """A step confirmed as it is queued can still fail on the device, its version never saved: the rollout
    queued behind it fails to switch to that version. Its groups go back to be generated again (attempt + 1),
    not counted as a failed task; without a confirmed step, the same failure is the task's own."""
    from workers.policy import resident

    run_id = create_run(api, user, domain, "confirmed, then failed", ASYNC)
    services.do_start_run(Run.objects.get(pk=run_id), actor=user)
    tick.advance(run_id)
    group_ids = list(PromptGroup.objects.filter(run_id=run_id).values_list("pk", flat=True))
    # the device then failed: nothing was saved there, and the step is not ok
    assert rollout_behind_a_step_given_up(run_id, group_ids, tmp_path / "never-saved", monkeypatch) == [0]
    assert not Trajectory.objects.filter(run_id=run_id).exists()
    groups = PromptGroup.objects.filter(pk__in=group_ids)
    assert {(g.status, g.attempt) for g in groups} == {("admitted", 1)}
    # no confirmed step: a failure on the device is the task's own, raised for the failure handler

    def device_lost(*args, **kwargs):
        raise RuntimeError("the device process exited")

    monkeypatch.setattr(resident, "rollout", device_lost)
    with pytest.raises(RuntimeError, match="device process exited"):
        generation.generate(run_id, group_ids, "test@here")
