"""Control-queue tasks: each call takes the next step of one run's loop (admit, train, pause, complete)."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from functools import partial

from django.db import transaction
from django.utils import timezone

from workers.celery import app

log = logging.getLogger(__name__)


def stall_after() -> timedelta:
    from django.conf import settings

    return timedelta(seconds=settings.TEMPER_STALL_SECONDS)


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
    for run in runs:
        stalled = pipeline.recover_stalled(run, stall_after())
        size = RunSpec.model_validate(run.spec).pipeline.rollout_batch_prompts
        ids = stalled["generate"]
        for chunk in (ids[i:i + size] for i in range(0, len(ids), size)):
            send_generate(run.pk, chunk, stalled["attempts"][chunk[0]])
        for gid in stalled["verify"]:
            verify_group.apply_async((gid,), task_id=pipeline.verify_task_id(run.pk, gid, stalled["attempts"][gid]))
        claim = run.state.get("train_claim")
        if claim and (run.updated_at < timezone.now() - stall_after()):
            send_train(run.pk, int(claim))
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
