"""Exporting a policy version (queue ``train``: the worker that has torch): a zip of the LoRA adapter or of
the merged Hugging Face model, with ``temper_manifest.json`` (``webapp.runs.exports.build_export``)."""

from __future__ import annotations

from webapp.runs.exports import build_export
from workers.celery import app


@app.task(name="workers.tasks.train.export_version")
def export_version(version_id: int, fmt: str) -> str:
    return build_export(version_id, fmt)
