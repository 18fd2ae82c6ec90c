"""Verify-queue tasks: judge a group's samples, and calibrate a verifier."""

from __future__ import annotations

import logging
import time
from typing import Any

from workers.celery import app

log = logging.getLogger(__name__)


def judge(verifier_row: Any, prompt: str, completion: str, reference: Any) -> Any:
    """One verdict. A verifier that crashes gives ``invalid`` with the reason, never a score of 0."""
    from workers.verifiers.base import JudgeInput, get_verifier, invalid

    if verifier_row is None:
        return invalid("the domain has no verifier")
    started = time.monotonic()
    try:
        return get_verifier(verifier_row.kind, verifier_row.config).judge(JudgeInput(prompt=prompt, completion=completion, reference=reference))
    except Exception as exc:
        return invalid(f"verifier crashed: {type(exc).__name__}: {exc}").with_latency(
            (time.monotonic() - started) * 1000)


@app.task(name="workers.tasks.verify.verify_batch", ignore_result=True)
def verify_batch(run_id: int, group_ids: list[int], attempts: list[int]) -> str:
    """Fan a rollout batch out: a ``verify_group`` message for each group but the first, judged here.

    The first group's message is this one (same task id), so revoking a run's queued work covers both.
    """
    from webapp.runs.pipeline import verify_task_id

    with app.producer_or_acquire() as producer:
        for gid, attempt in zip(group_ids[1:], attempts[1:], strict=True):
            verify_group.apply_async((gid,), producer=producer, task_id=verify_task_id(run_id, gid, attempt))
    return str(verify_group(group_ids[0]))


@app.task(name="workers.tasks.verify.verify_group", ignore_result=True)
def verify_group(group_id: int) -> str:
    """Judge every pending sample of a group; when all are judged, the group joins the ready buffer.

    The group's verdicts are written together once judged (a redelivered task judges only what is still
    missing). An invalid verdict is stored as invalid, never as a score: the trainer leaves it out, the
    group counts it, and its prompt is admitted again ahead of new ones (``pipeline.invalid_retries``).
    Timings go on the group (``verify_wait_s``, ``verify_s``); the train step reports them per domain, so
    verification sends no websocket message of its own.
    """
    from django.db import transaction
    from django.utils import timezone

    from webapp.runs import pipeline
    from webapp.runs.models import PromptGroup, Run, RunStatus, Trajectory, Verdict
    from workers.pipeline.spec import RunSpec
    from workers.tasks.control import advance_run

    group = PromptGroup.objects.select_related("domain__verifier", "task", "run").filter(pk=group_id).first()
    if group is None or group.status != PromptGroup.Status.VERIFYING:
        return "skipped"
    started, wait = time.monotonic(), (timezone.now() - group.updated_at).total_seconds()
    reference = group.task.reference if group.task else {}
    verifier = group.domain.verifier if group.domain else None
    pending = Trajectory.objects.filter(run_id=group.run_id, group_key=group.key, verdict=Verdict.PENDING)
    verdicts = [(t.pk, judge(verifier, t.prompt, t.completion, reference))
                for t in pending.only("id", "prompt", "completion").order_by("sample_index")]
    with transaction.atomic():
        for pk, verdict in verdicts:
            pipeline.record_verdict(pk, status=verdict.status, score=verdict.score, reason=verdict.reason or "",
                                    details=verdict.to_dict().get("details", {}), latency_ms=verdict.latency_ms)
        PromptGroup.objects.filter(pk=group.pk, verify_s__isnull=True).update(
            verify_wait_s=wait, verify_s=time.monotonic() - started)
    spec = RunSpec.model_validate(group.run.spec)
    status = pipeline.finish_verification(group, spec.pipeline.invalid_retries)
    if status is None:
        return "pending"
    # Verification changes what the control worker would do only when a batch is ready to train, a group
    # was dropped (it frees admission room), or the run is pausing or ended: otherwise spare it a call.
    run_status, state = Run.objects.filter(pk=group.run_id).values_list("status", "state").get()
    ready = PromptGroup.objects.filter(run_id=group.run_id, status=PromptGroup.Status.READY).count()
    if (status == PromptGroup.Status.DROPPED or run_status != RunStatus.RUNNING
            or (ready >= spec.pipeline.batch_prompts and not state.get("train_claim"))):
        advance_run.delay(group.run_id)
    return status


@app.task(name="workers.tasks.verify.calibrate_verifier")
def calibrate_verifier(report_id: int) -> str:
    """Run the calibration of a pending report. Idempotent: a report already claimed is left alone."""
    from webapp.catalog.models import CalibrationReport
    from webapp.catalog.services import do_run_calibration

    claimed = CalibrationReport.objects.filter(
        pk=report_id, status=CalibrationReport.Status.PENDING
    ).update(status=CalibrationReport.Status.RUNNING)
    if not claimed:
        return "already claimed"
    report = do_run_calibration(CalibrationReport.objects.select_related("verifier").get(pk=report_id))
    return "error" if report.error else ("passed" if report.passed else "failed")
