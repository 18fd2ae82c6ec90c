"""Verify-queue tasks: calibrate a verifier (judge its cases several times) and store the report."""

from __future__ import annotations

import logging
from typing import Any, cast

from workers.celery import app

log = logging.getLogger(__name__)


@app.task(name="workers.tasks.verify.calibrate_verifier")
def calibrate_verifier(report_id: int) -> str:
    """Run the calibration of a pending report. Idempotent: a report already claimed is left alone."""
    from webapp.catalog.models import CalibrationReport
    from webapp.catalog.services import do_record_calibration
    from workers.verifiers.base import JudgeInput, build_verifier
    from workers.verifiers.calibration import CalibrationCase, calibrate

    claimed = CalibrationReport.objects.filter(
        pk=report_id, status=CalibrationReport.Status.PENDING
    ).update(status=CalibrationReport.Status.RUNNING)
    if not claimed:
        return "already claimed"
    report = CalibrationReport.objects.select_related("verifier").get(pk=report_id)
    verifier_row = report.verifier
    try:
        verifier = build_verifier(verifier_row.kind, verifier_row.config)
        cases = [
            CalibrationCase(input=JudgeInput(prompt=c.prompt, completion=c.completion, reference=c.reference),
                            expected=cast(Any, c.expected), label=cast(Any, c.label))
            for c in verifier_row.calibration_cases.all()
        ]
        outcome = calibrate(verifier, cases)
    except Exception as exc:  # a broken verifier is reported on its calibration, not lost in a log
        log.exception("calibration %s failed", report_id)
        do_record_calibration(report, passed=None, summary={}, error=f"{type(exc).__name__}: {exc}")
        return "error"
    do_record_calibration(report, passed=outcome.passed, summary=outcome.to_dict())
    return "passed" if outcome.passed else "failed"
