"""Exporting a policy version (queue ``train``: the worker that has torch): a zip of the LoRA adapter or of
the merged Hugging Face model, with ``temper_manifest.json``. Written under a temporary name and renamed,
so a download never sees half a file; a failure is recorded on the version with its reason."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import zipfile
from pathlib import Path

from workers.celery import app


@app.task(name="workers.tasks.train.export_version")
def export_version(version_id: int, fmt: str) -> str:
    from webapp.runs import pipeline
    from webapp.runs.exports import export_path, manifest, record_export
    from webapp.runs.models import PolicyVersion

    version = PolicyVersion.objects.select_related("run__base_model", "parent").filter(pk=version_id).first()
    if version is None:
        return "gone"
    try:
        out = export_path(version, fmt)
        out.parent.mkdir(parents=True, exist_ok=True)
        base_dir = pipeline.resolve_model_path(version.run.base_model)
        vdir = pipeline.version_dir(version.run_id, version.number)
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
            digest = hashlib.sha256()
            with partial.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
            partial.rename(out)
        record_export(version_id, fmt, path=out, size=out.stat().st_size, sha256=digest.hexdigest())
        return str(out)
    except Exception as exc:  # recorded on the version, shown on its page
        record_export(version_id, fmt, error=f"{type(exc).__name__}: {exc}")
        return f"error: {exc}"
