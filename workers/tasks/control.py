"""Control-queue tasks: each call takes the next step of one run's loop (admit, train, pause, complete)."""

from __future__ import annotations

import logging
from datetime import timedelta
from functools import partial

from django.db import transaction
from django.utils import timezone

from workers.celery import app

log = logging.getLogger(__name__)


def stall_after() -> timedelta:
    from django.conf import settings

    return timedelta(seconds=settings.TEMPER_STALL_SECONDS)


@app.task(name="workers.tasks.control.advance_run")
def advance_run(run_id: int) -> str:
    """Take the next step of a run's loop. Idempotent: re-reads the run under its row lock and acts on it."""
    from webapp.common.errors import InvalidTransition
    from webapp.runs import pipeline, services
    from webapp.runs.models import PromptGroup, Run, RunStatus
    from workers.pipeline.scheduler import plan
    from workers.pipeline.spec import RunSpec
    from workers.tasks.rollout import evaluate, generate
    from workers.tasks.train import train_step

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
                    return "completed"
                if decision.train:
                    step = run.step + 1
                    run.state["train_claim"] = step
                    # updated_at marks when the claim was made: the recovery tick re-issues it only once stale
                    Run.objects.filter(pk=run.pk).update(state=run.state, updated_at=timezone.now())
                    transaction.on_commit(partial(train_step.delay, run_id, step))
                if decision.admit_total:
                    ids = pipeline.apply_admission(run, decision)
                    size = limits.rollout_batch
                    for chunk in (ids[i:i + size] for i in range(0, len(ids), size)):
                        transaction.on_commit(partial(generate.delay, run_id, chunk))
            elif run.status == RunStatus.PAUSING:
                if pipeline.in_flight(run) == 0 and not run.state.get("train_claim"):
                    services.do_mark_paused(run)
            elif run.status in (RunStatus.CANCELLED, RunStatus.FAILED):
                PromptGroup.objects.filter(run=run).exclude(
                    status__in=[PromptGroup.Status.TRAINED, PromptGroup.Status.DROPPED]
                ).update(status=PromptGroup.Status.DROPPED, drop_reason=f"run {run.status}")
    except InvalidTransition as exc:  # another delivery or a person moved it first
        log.info("advance_run(%s): %s", run_id, exc)
    return str(Run.objects.filter(pk=run_id).values_list("status", flat=True).first())


@app.task(name="workers.tasks.control.kick_active_runs")
def kick_active_runs() -> int:
    """Periodic (celery beat in the control worker): re-issue work a lost message left behind, advance runs.

    This is what makes a Redis restart harmless: the database says which groups are stuck, and they are
    queued again (at most three attempts each).
    """
    from webapp.runs import pipeline
    from webapp.runs.models import Run, RunStatus
    from workers.tasks.rollout import generate
    from workers.tasks.train import train_step
    from workers.tasks.verify import verify_group

    runs = list(Run.objects.filter(status__in=[RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.PAUSING]))
    for run in runs:
        stalled = pipeline.recover_stalled(run, stall_after())
        if stalled["generate"]:
            generate.delay(run.pk, stalled["generate"])
        for gid in stalled["verify"]:
            verify_group.delay(gid)
        claim = run.state.get("train_claim")
        if claim and (run.updated_at < pipeline.timezone.now() - stall_after()):
            train_step.delay(run.pk, claim)
        advance_run.delay(run.pk)
    return len(runs)


def _kick_seconds() -> float:
    from django.conf import settings

    return float(settings.TEMPER_KICK_SECONDS)


app.conf.beat_schedule = {
    "kick-active-runs": {"task": "workers.tasks.control.kick_active_runs", "schedule": _kick_seconds()},
}
