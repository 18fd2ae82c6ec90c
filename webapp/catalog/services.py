"""State changes of the catalog, each a named function (the only writers besides the import module)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import transaction
from django.utils import timezone

from webapp.catalog.models import CalibrationReport, CalibrationStatus, Verifier
from webapp.catalog.task_import import ImportFailed, ImportResult, import_tasks
from webapp.common.errors import InvalidTransition

__all__ = ["ImportFailed", "ImportResult", "do_import_tasks", "do_record_calibration", "do_request_calibration"]

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
