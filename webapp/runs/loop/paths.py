"""Where a run's files live in the artifact store: the base model's directory and the policy versions."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from webapp.catalog.models import BaseModel


def resolve_model_path(base_model: BaseModel) -> Path:
    """A base model's directory: absolute, under ARTIFACTS_ROOT, or relative to the project."""
    path = Path(base_model.path)
    if path.is_absolute():
        return path
    for root in (Path(settings.ARTIFACTS_ROOT), Path(settings.BASE_DIR)):
        if (root / path).exists():
            return root / path
    return Path(settings.BASE_DIR) / path


def run_dir(run_id: int) -> Path:
    return Path(settings.ARTIFACTS_ROOT) / "runs" / str(run_id)


def version_dir(run_id: int, number: int) -> Path | None:
    """Version ``number`` of a run (None for version 0: the base model itself)."""
    return None if number == 0 else run_dir(run_id) / "versions" / f"v{number:05d}"
