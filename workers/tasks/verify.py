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


@app.task(name="workers.tasks.verify.verify_group")
def verify_group(group_id: int) -> str:
    """Judge every pending sample of a group; when all are judged, the group joins the ready buffer."""
    from webapp.runs import pipeline
    from webapp.runs.metrics import Point
    from webapp.runs.models import PromptGroup, Verdict
    from workers.tasks.control import advance_run
    from workers.telemetry import emit

    group = PromptGroup.objects.select_related("domain__verifier", "task").filter(pk=group_id).first()
    if group is None or group.status != PromptGroup.Status.VERIFYING:
        return "skipped"
    reference = group.task.reference if group.task else {}
    latencies = []
    for trajectory in pipeline.group_trajectories(group):
        if trajectory.verdict != Verdict.PENDING:
            continue
        verdict = judge(group.domain.verifier if group.domain else None, trajectory.prompt, trajectory.completion,
                        reference)
        latencies.append(verdict.latency_ms)
        pipeline.record_verdict(trajectory.pk, status=verdict.status, score=verdict.score,
                                reason=verdict.reason or "", details=verdict.to_dict().get("details", {}),
                                latency_ms=verdict.latency_ms)
    if pipeline.finish_verification(group):
        if latencies:
            latencies.sort()
            emit(group.run_id, [Point("verify_latency_ms_p50", group.run.step, latencies[len(latencies) // 2],
                                      domain_id=group.domain_id)])
        advance_run.delay(group.run_id)
        return "ready"
    return "pending"


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
