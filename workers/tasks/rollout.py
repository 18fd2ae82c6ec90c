"""Rollout-queue tasks (GPU worker): generate a batch of groups under the run's newest version; sample a
version's held-out evaluation."""

from __future__ import annotations

from webapp.runs.loop import generation, heldout
from workers.celery import app
from workers.tasks.health import this_worker


@app.task(name="workers.tasks.rollout.generate", ignore_result=True)
def generate(run_id: int, group_ids: list[int]) -> int:
    """Sample G completions for each claimed group, write them, and hand the batch to verification."""
    return generation.generate(run_id, group_ids, holder=this_worker())


@app.task(name="workers.tasks.rollout.evaluate", ignore_result=True)
def evaluate(run_id: int, version: int) -> int:
    """Held-out evaluation of one version, the device half (scored on the verify queue)."""
    return heldout.sample(run_id, version)
