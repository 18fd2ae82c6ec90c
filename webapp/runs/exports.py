"""Exporting a policy version: a LoRA adapter or a merged Hugging Face model directory, zipped with a
manifest (base model, run, step, parent, evaluation results) and served for download.

The web process only asks for an export and serves the finished file; the merging itself needs torch and
runs on the ``train`` queue (``workers.tasks.export.export_version``). Status lives on the version, in
``metadata["exports"][format]``: ``queued`` → ``done`` (path, size, sha256) or ``error`` (the reason).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from webapp.common.errors import InvalidTransition, ValidationFailed
from webapp.runs.models import Evaluation, PolicyVersion

FORMATS = ("adapter", "merged")


def export_path(version: PolicyVersion, fmt: str) -> Path:
    return Path(settings.ARTIFACTS_ROOT) / "exports" / f"run{version.run_id}-v{version.number:05d}-{fmt}.zip"


def manifest(version: PolicyVersion, fmt: str) -> dict[str, Any]:
    run = version.run
    evaluations = Evaluation.objects.filter(version=version, status=Evaluation.Status.DONE).select_related("domain")
    return {
        "format": fmt,
        "base_model": {"id": run.base_model_id, "name": run.base_model.name, "path": run.base_model.path},
        "run": {"id": run.pk, "name": run.name, "spec": run.spec},
        "version": version.number,
        "parent": version.parent.number if version.parent else None,
        "step": version.step,
        "created_at": version.created_at.isoformat(),
        "evaluations": [{"domain": e.domain.name, "suite": e.suite, "score": e.score, "pass_rate": e.pass_rate,
                         "n_tasks": e.n_tasks, "n_samples": e.n_samples, "invalid": e.invalid_count}
                        for e in evaluations.order_by("domain__name", "suite")],
        "exported_at": timezone.now().isoformat(),
    }


def _set_status(version_id: int, fmt: str, status: dict[str, Any]) -> None:
    with transaction.atomic():
        row = PolicyVersion.objects.select_for_update().get(pk=version_id)
        exports = dict(row.metadata.get("exports", {}))
        exports[fmt] = status
        row.metadata = {**row.metadata, "exports": exports}
        row.save(update_fields=["metadata"])


def export_status(version: PolicyVersion, fmt: str) -> dict[str, Any] | None:
    status: dict[str, Any] | None = version.metadata.get("exports", {}).get(fmt)
    return status


def do_request_export(version: PolicyVersion, fmt: str) -> dict[str, Any]:
    """Queue an export on the train queue (a finished one is kept; ask again to rebuild after an error)."""
    if fmt not in FORMATS:
        raise ValidationFailed(f"unknown export format {fmt!r}", details={"format": [f"one of {', '.join(FORMATS)}"]})
    if fmt == "adapter" and version.number == 0:
        raise InvalidTransition("version 0 is the base model itself: it has no adapter (export it merged)")
    current = export_status(version, fmt)
    if current and current.get("status") == "queued":
        return current
    status = {"status": "queued", "requested_at": timezone.now().isoformat()}
    _set_status(version.pk, fmt, status)

    def enqueue() -> None:
        from workers.tasks.export import export_version

        export_version.apply_async(args=[version.pk, fmt], queue="train")

    transaction.on_commit(enqueue)
    return status


def record_export(version_id: int, fmt: str, *, path: Path | None = None, size: int = 0, sha256: str = "",
                  error: str = "") -> None:
    if error:
        _set_status(version_id, fmt, {"status": "error", "error": error, "finished_at": timezone.now().isoformat()})
    else:
        _set_status(version_id, fmt, {"status": "done", "path": str(path), "size": size, "sha256": sha256,
                                      "finished_at": timezone.now().isoformat()})
