"""Exporting a policy version: a LoRA adapter or a merged Hugging Face model directory, zipped with a
manifest (base model, run, step, parent, evaluation results) and served for download.

The web process only asks for an export and serves the finished file; the merging itself needs torch and
runs on the ``train`` queue (``build_export``, called by ``workers.tasks.export.export_version``). Status lives on the version, in
``metadata["exports"][format]``: ``queued`` → ``done`` (path, size, sha256) or ``error`` (the reason).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from webapp.common.errors import InvalidTransition, ValidationFailed
from webapp.runs.models import Evaluation, PolicyVersion
from workers import messages

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

    transaction.on_commit(partial(messages.export_version, version.pk, fmt))
    return status


def record_export(version_id: int, fmt: str, *, path: Path | None = None, size: int = 0, sha256: str = "",
                  error: str = "") -> None:
    if error:
        _set_status(version_id, fmt, {"status": "error", "error": error, "finished_at": timezone.now().isoformat()})
    else:
        _set_status(version_id, fmt, {"status": "done", "path": str(path), "size": size, "sha256": sha256,
                                      "finished_at": timezone.now().isoformat()})


def build_export(version_id: int, fmt: str) -> str:
    """Build a version's export zip (on the worker that has torch): written under a temporary name and
    renamed, so a download never sees half a file; a failure is recorded on the version with its reason."""
    import hashlib
    import shutil
    import tempfile
    import zipfile

    from webapp.runs.loop import paths

    version = PolicyVersion.objects.select_related("run__base_model", "parent").filter(pk=version_id).first()
    if version is None:
        return "gone"
    try:
        out = export_path(version, fmt)
        out.parent.mkdir(parents=True, exist_ok=True)
        base_dir = paths.resolve_model_path(version.run.base_model)
        vdir = paths.version_dir(version.run_id, version.number)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            stage = Path(tmp) / "model"
            if fmt == "adapter":
                if vdir is None or not (vdir / "adapter_config.json").exists():
                    raise ValueError(f"v{version.number} holds full weights, not a LoRA adapter: export it merged")
                shutil.copytree(vdir, stage)
            elif vdir is None:  # version 0: the base model itself
                shutil.copytree(base_dir, stage)
            else:
                from workers.policy.versions import export_merged

                export_merged(vdir, stage, base_dir)
            (stage / "temper_manifest.json").write_text(json.dumps(manifest(version, fmt), indent=2, default=str))
            partial = out.with_suffix(".partial")
            with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as archive:
                for path in sorted(stage.rglob("*")):
                    if path.is_file():
                        archive.write(path, Path(f"run{version.run_id}-v{version.number}-{fmt}") / path.relative_to(stage))
            with partial.open("rb") as f:
                digest = hashlib.file_digest(f, "sha256")
            partial.rename(out)
        record_export(version_id, fmt, path=out, size=out.stat().st_size, sha256=digest.hexdigest())
        return str(out)
    except Exception as exc:  # recorded on the version, shown on its page
        record_export(version_id, fmt, error=f"{type(exc).__name__}: {exc}")
        return f"error: {exc}"
