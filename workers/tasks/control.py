"""Control-queue tasks: each call takes the next step of one run's loop (admit, train, pause, complete)."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from functools import partial
from typing import Any

from django.db import transaction
from django.utils import timezone

from workers.celery import app

log = logging.getLogger(__name__)


def stall_after() -> timedelta:
    from django.conf import settings

    return timedelta(seconds=settings.TEMPER_STALL_SECONDS)


def silent_after() -> timedelta:
    from workers.tasks.health import silent_seconds

    return timedelta(seconds=silent_seconds())


BROKER_EPOCH_KEY = "temper:broker-epoch"


def broker_was_reset() -> bool:
    """True once after the broker lost its data (a Redis restarted without persistence, as ``make run``'s
    embedded one always is): every queued message is gone, so all work in flight must be handed out again
    now rather than after the stall timeout. A marker key in Redis tells: it is set here and vanishes with
    the data. (On the very first tick it is missing too; re-issuing then is harmless: every task is
    idempotent.)"""
    import redis
    from django.conf import settings

    try:
        return bool(redis.Redis.from_url(settings.REDIS_URL).set(BROKER_EPOCH_KEY, str(time.time()), nx=True))
    except redis.RedisError:
        return False


def send_generate(run_id: int, group_ids: list[int], attempt: int = 0) -> None:
    from webapp.runs.pipeline import generate_task_id
    from workers.tasks.rollout import generate

    generate.apply_async((run_id, group_ids), task_id=generate_task_id(run_id, group_ids[0], attempt))


def send_train(run_id: int, step: int) -> None:
    from webapp.runs.pipeline import train_task_id
    from workers.tasks.train import train_step

    train_step.apply_async((run_id, step), task_id=train_task_id(run_id, step))


def revoke(task_ids: list[str]) -> None:
    """Ask every worker to discard these queued tasks (one broadcast). A worker that misses it (started
    later, or Redis away) still does nothing: each task re-reads its run and finds it ended."""
    if not task_ids:
        return
    try:
        app.control.revoke(task_ids)
    except Exception as exc:  # the broadcast is an optimisation; the database already says "ended"
        log.warning("revoking %d task(s) failed: %s", len(task_ids), exc)


@app.task(name="workers.tasks.control.advance_run", ignore_result=True)
def advance_run(run_id: int) -> str:
    """Take the next step of a run's loop. Idempotent: re-reads the run under its row lock and acts on it."""
    from webapp.common.errors import InvalidTransition
    from webapp.runs import pipeline, services
    from webapp.runs.models import Run, RunStatus
    from workers.pipeline.scheduler import plan
    from workers.pipeline.spec import RunSpec
    from workers.tasks.rollout import evaluate

    try:
        with transaction.atomic():
            run = Run.objects.select_for_update().filter(pk=run_id).first()
            if run is None:
                return "gone"
            if run.status == RunStatus.QUEUED:
                first_start = run.started_at is None
                run = services.do_mark_running(run)
                if first_start:
                    transaction.on_commit(partial(evaluate.delay, run_id, 0))  # the base model's held-out level
            if run.status == RunStatus.RUNNING:
                spec = RunSpec.model_validate(run.spec)
                limits = pipeline.limits_for(spec)
                # a group too stale to train must not count towards a batch: the claim would find nothing
                pipeline.drop_stale(run, limits.max_staleness, run.step + 1)
                decision = plan(pipeline.snapshot(run), limits)
                if decision.complete:
                    services.do_complete_run(run, f"reached max_steps={spec.max_steps}")
                    pipeline.drop_unfinished(run, "run completed before it was trained")
                    return "completed"
                if decision.train:
                    step = run.step + 1
                    run.state["train_claim"] = step
                    run.state["train_claim_at"] = time.time()
                    # updated_at marks when the claim was made: the recovery tick re-issues it only once stale
                    Run.objects.filter(pk=run.pk).update(state=run.state, updated_at=timezone.now())
                    transaction.on_commit(partial(send_train, run_id, step))
                if decision.admit_total:
                    ids = pipeline.apply_admission(run, decision)
                    size = limits.rollout_batch
                    for chunk in (ids[i:i + size] for i in range(0, len(ids), size)):
                        transaction.on_commit(partial(send_generate, run_id, chunk))
            elif run.status == RunStatus.PAUSING:
                if pipeline.in_flight(run) == 0 and not run.state.get("train_claim"):
                    services.do_mark_paused(run)
            elif run.status in (RunStatus.CANCELLED, RunStatus.FAILED, RunStatus.COMPLETED):
                # revoke what is still queued for it, then drop whatever was not trained, with the reason
                transaction.on_commit(partial(revoke, pipeline.queued_task_ids(run)))
                pipeline.drop_unfinished(run, f"run {run.status} before it was trained")
    except InvalidTransition as exc:  # another delivery or a person moved it first
        log.info("advance_run(%s): %s", run_id, exc)
    return str(Run.objects.filter(pk=run_id).values_list("status", flat=True).first())


@app.task(name="workers.tasks.control.kick_active_runs", ignore_result=True)
def kick_active_runs() -> int:
    """Periodic (celery beat): re-issue work a lost message left behind, check each run's health, advance it.

    This is what makes a Redis restart harmless: the database says which groups are stuck, and they are
    queued again (at most three attempts each).
    """
    from webapp.runs import pipeline
    from webapp.runs.models import Run, RunStatus
    from workers.pipeline.spec import RunSpec
    from workers.tasks.health import check_run_health
    from workers.tasks.verify import verify_group

    runs = list(Run.objects.filter(status__in=[RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.PAUSING]))
    everything = broker_was_reset()
    liveness = pipeline.WorkerLiveness.now(silent_after())
    for run in runs:
        stalled = pipeline.recover_stalled(run, stall_after(), liveness=liveness, everything=everything)
        if stalled["why"]:
            log.warning("run %s: re-issuing work (%s)", run.pk, stalled["why"])
        size = RunSpec.model_validate(run.spec).pipeline.rollout_batch_prompts
        ids = stalled["generate"]
        for chunk in (ids[i:i + size] for i in range(0, len(ids), size)):
            send_generate(run.pk, chunk, stalled["attempts"][chunk[0]])
        for gid in stalled["verify"]:
            verify_group.apply_async((gid,), task_id=pipeline.verify_task_id(run.pk, gid, stalled["attempts"][gid]))
        if why := pipeline.train_claim_orphaned(run, stall_after(), liveness=liveness, everything=everything):
            log.warning("run %s: re-sending train step %s (%s)", run.pk, run.state["train_claim"], why)
            send_train(run.pk, int(run.state["train_claim"]))
        if run.status == RunStatus.RUNNING:
            check_run_health(run.pk)
        advance_run.delay(run.pk)
    return len(runs)


def _kick_seconds() -> float:
    from django.conf import settings

    return float(settings.TEMPER_KICK_SECONDS)


app.conf.beat_schedule = {
    "kick-active-runs": {"task": "workers.tasks.control.kick_active_runs", "schedule": _kick_seconds()},
}


@app.task(name="workers.tasks.control.report_step", ignore_result=True)
def report_step(run_id: int, step: int) -> int:
    """Metrics of a finished train step, read back from the database; then health checks and evaluation.

    Runs on the control queue so that the GPU worker goes back to the device as soon as the step is
    recorded. Idempotent: a step is reported once (``PolicyVersion.metrics["reported"]``).
    """
    from webapp.runs.models import PolicyVersion, Run
    from workers.pipeline.spec import RunSpec
    from workers.tasks.health import check_run_health
    from workers.tasks.rollout import evaluate
    from workers.telemetry import emit

    with transaction.atomic():
        version = PolicyVersion.objects.select_for_update().filter(run_id=run_id, step=step, number__gt=0).first()
        run = Run.objects.filter(pk=run_id).first()
        if version is None or run is None or version.metrics.get("reported"):
            return 0
        PolicyVersion.objects.filter(pk=version.pk).update(metrics={**version.metrics, "reported": True})
        points = step_points(run, version)
        emit(run_id, points)
    check_run_health(run_id)
    spec = RunSpec.model_validate(run.spec)
    if spec.eval_every and version.number % spec.eval_every == 0:
        evaluate.delay(run_id, version.number)
    return len(points)


def step_points(run: Any, version: Any) -> list[Any]:
    """The metric points of train step ``version.step``: trainer, data, stage timings, queue depths."""
    import statistics
    from collections import Counter, defaultdict

    from django.db.models import Count

    from webapp.runs import pipeline
    from webapp.runs.metrics import Point
    from webapp.runs.models import PromptGroup, Trajectory, Verdict

    step, m = version.step, version.metrics
    points = [Point(name, step, float(m[name])) for name in (
        "loss", "clip_fraction", "kl", "entropy", "grad_norm", "iw_mean", "iw_max", "tokens_trained", "reward_mean",
        "train_seconds", "train_task_seconds", "train_queue_wait_s") if isinstance(m.get(name), (int, float))]
    points.append(Point("nonfinite", step, float(bool(m.get("nonfinite")))))
    groups = list(PromptGroup.objects.filter(run=run, trained_step=step, status=PromptGroup.Status.TRAINED))
    points.append(Point("zero_variance_share", step,
                        float(m.get("groups_dropped_zero_variance") or 0) / max(1, len(groups))))
    samples = list(Trajectory.objects.filter(run=run, trained_step=step).values_list(
        "domain_id", "version", "verdict", "reward", "finish_reason", "verify_latency_ms", "completion_token_ids"))
    total = len(samples)
    lags = [version.number - 1 - v for _, v, *_ in samples]
    points += [
        Point("invalid_rate", step, sum(s[2] == Verdict.INVALID for s in samples) / max(1, total)),
        Point("truncation_rate", step, sum(s[4] == "length" for s in samples) / max(1, total)),
        Point("staleness_mean", step, statistics.fmean(lags) if lags else 0.0),
        Point("staleness_max", step, float(max(lags, default=0))),
    ]
    points += [Point(f"staleness_lag_{lag}", step, float(n)) for lag, n in sorted(Counter(lags).items())]
    rewards: defaultdict[int | None, list[float]] = defaultdict(list)
    latency: defaultdict[int | None, list[float]] = defaultdict(list)
    for sample_domain, _, _, reward, _, latency_ms, _ in samples:
        if reward is not None:
            rewards[sample_domain].append(reward)
        if latency_ms is not None:
            latency[sample_domain].append(latency_ms)
    for domain_id, values in rewards.items():
        points.append(Point("reward", step, statistics.fmean(values), domain_id=domain_id))
        points.append(Point("pass_rate", step, sum(r >= 1.0 for r in values) / len(values), domain_id=domain_id))
    for domain_id, values in latency.items():
        points.append(Point("verify_latency_ms_p50", step, quantile(values, 0.5), domain_id=domain_id))
        points.append(Point("verify_latency_ms_p95", step, quantile(values, 0.95), domain_id=domain_id))
    for name, attr in (("verify_queue_wait_s", "verify_wait_s"), ("verify_group_s", "verify_s")):
        per_domain: defaultdict[int | None, list[float]] = defaultdict(list)
        for g in groups:
            if getattr(g, attr) is not None:
                per_domain[g.domain_id].append(getattr(g, attr))
        for domain_id, values in per_domain.items():
            points.append(Point(f"{name}_p50", step, quantile(values, 0.5), domain_id=domain_id))
            points.append(Point(f"{name}_p95", step, quantile(values, 0.95), domain_id=domain_id))
    generated = sum(g.generate_s for g in groups if g.generate_s is not None)
    if generated > 0:
        tokens = sum(len(s[6] or []) for s in samples)
        points += [Point("generate_seconds", step, generated), Point("tokens_per_s", step, tokens / generated),
                   Point("trajectories_per_s", step, total / generated)]
    waits = [g.generate_wait_s for g in groups if g.generate_wait_s is not None]
    if waits:
        points.append(Point("generate_queue_wait_s", step, statistics.fmean(waits)))
    counts = dict(PromptGroup.objects.filter(run=run).values_list("status").annotate(n=Count("id")))
    for status in ("admitted", "generating", "verifying", "ready"):
        points.append(Point(f"groups_{status}", step, float(counts.get(status, 0))))
    points.append(Point("in_flight", step, float(sum(counts.get(s, 0) for s in ("admitted", "generating", "verifying")))))
    window = run.state.get("step_window")  # [previous step's end, this step's end], wall clock
    if window and window[1] > window[0] and run.step == step:
        points.append(Point("gpu_busy", step, min(1.0, pipeline.take_busy(run.pk) / (window[1] - window[0]))))
    return points


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
