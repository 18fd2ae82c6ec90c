"""Train-queue task (GPU worker): one GRPO step on B ready groups, then policy version v+1."""

from __future__ import annotations

from webapp.runs.loop import training
from workers.celery import app
from workers.tasks.health import this_worker


@app.task(name="workers.tasks.train.train_step", ignore_result=True)
def train_step(run_id: int, step: int) -> str:
    """Train step ``step`` of a run. Idempotent: a finished step is skipped; a redelivered one re-finds its groups."""
    version = training.run_step(run_id, step, holder=this_worker())
    return "nothing done" if version is None else f"v{version}"
