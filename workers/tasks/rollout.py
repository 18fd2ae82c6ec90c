"""Rollout-queue tasks (GPU worker): generate a batch of groups under the run's newest version; sample a
version's held-out evaluation."""

from __future__ import annotations

from typing import Any

from webapp.runs.loop import generation, heldout
from workers.celery import app
from workers.tasks.health import this_worker


@app.task(name="workers.tasks.rollout.generate", ignore_result=True)
def generate(run_id: int, group_ids: list[int]) -> int:
    """Sample G completions for each claimed group, write them, and hand the batch to verification."""
    return generation.generate(run_id, group_ids, holder=this_worker())


@app.task(name="workers.tasks.rollout.evaluate", ignore_result=True, bind=True)
def evaluate(self: Any, run_id: int, version: int, offset: int = 0, samples: int | None = None,
             chain: str = "") -> int:
    """Held-out evaluation of one version, the device half, a chunk from task ``offset`` on (scored on the
    verify queue after the last chunk). The first message's task id names the evaluation's chain."""
    return heldout.sample(run_id, version, offset, samples, chain or str(self.request.id or ""))
