"""Train-queue task (GPU worker): one GRPO step on B ready groups, then policy version v+1."""

from __future__ import annotations

import threading
from typing import Any

from celery import signals

from webapp.runs.loop import training
from workers.celery import app
from workers.tasks.health import this_worker

_stopping = threading.Event()


@signals.worker_shutting_down.connect
def _shutting_down(**kwargs: Any) -> None:
    _stopping.set()


@app.task(name="workers.tasks.train.train_step", ignore_result=True)
def train_step(run_id: int, step: int) -> str:
    """Train step ``step`` of a run, and the steps its record claims for this worker while batches are ready,
    until the worker shuts down (``training.run_step``). Idempotent: a finished step is skipped; a redelivered
    one re-finds its groups."""
    version = training.run_step(run_id, step, holder=this_worker(), go_on=lambda: not _stopping.is_set())
    return "nothing done" if version is None else f"v{version}"
