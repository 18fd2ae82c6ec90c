"""State changes of the catalog, each a named function (the only writers besides the import module)."""

from __future__ import annotations

import logging
from typing import Any, cast

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import transaction
from django.utils import timezone

from webapp.catalog.models import CalibrationReport, CalibrationStatus, Verifier
from webapp.catalog.task_import import ImportFailed, ImportResult, import_tasks
from webapp.common.errors import InvalidTransition

log = logging.getLogger(__name__)

__all__ = ["ImportFailed", "ImportResult", "do_import_tasks", "do_record_calibration", "do_request_calibration",
           "do_run_calibration"]

do_import_tasks = import_tasks


def do_request_calibration(verifier: Verifier, actor: AbstractBaseUser | AnonymousUser | None = None) -> CalibrationReport:
    """Create a pending calibration report and queue its job on the ``verify`` queue after commit."""
    if not verifier.calibration_cases.exists():
        raise InvalidTransition(
            f"verifier {verifier.name!r} has no calibration cases: add known-good, known-bad and hack cases first"
        )
    with transaction.atomic():
        report = CalibrationReport.objects.create(verifier=verifier)
        Verifier.objects.filter(pk=verifier.pk).update(calibration_status=CalibrationStatus.RUNNING)

        def enqueue() -> None:
            from workers.tasks.verify import calibrate_verifier

            calibrate_verifier.delay(report.pk)

        transaction.on_commit(enqueue)
    return report


def do_run_calibration(report: CalibrationReport) -> CalibrationReport:
    """Judge the report's verifier on its calibration cases now, in this process, and record the outcome.

    A verifier that cannot be built or crashes is recorded as an error on the report, not lost in a log.
    """
    from workers.verifiers.base import JudgeInput, build_verifier
    from workers.verifiers.calibration import CalibrationCase, calibrate

    verifier_row = report.verifier
    try:
        verifier = build_verifier(verifier_row.kind, verifier_row.config)
        cases = [
            CalibrationCase(input=JudgeInput(prompt=c.prompt, completion=c.completion, reference=c.reference),
                            expected=cast(Any, c.expected), label=cast(Any, c.label))
            for c in verifier_row.calibration_cases.all()
        ]
        outcome = calibrate(cast(Any, verifier), cases)
    except Exception as exc:
        log.exception("calibration %s failed", report.pk)
        do_record_calibration(report, passed=None, summary={}, error=f"{type(exc).__name__}: {exc}")
        return report
    do_record_calibration(report, passed=outcome.passed, summary=outcome.to_dict())
    return report


def do_record_calibration(report: CalibrationReport, *, passed: bool | None, summary: dict[str, Any], error: str = "") -> None:
    """Store a finished calibration and move the verifier's status accordingly."""
    report.status = CalibrationReport.Status.ERROR if error else CalibrationReport.Status.DONE
    report.passed = passed
    report.summary = summary
    report.error = error
    report.finished_at = timezone.now()
    report.save(update_fields=["status", "passed", "summary", "error", "finished_at", "updated_at"])
    status = CalibrationStatus.ERROR if error else (CalibrationStatus.PASSED if passed else CalibrationStatus.FAILED)
    Verifier.objects.filter(pk=report.verifier_id).update(calibration_status=status, updated_at=timezone.now())
