"""Recovery, the database half: who is known gone, whether the broker lost its messages, and handing work
out again after a task failed.

What is stranded is decided by the scheduler (``scheduler.decide`` with ``recovering``); this module
supplies its facts and applies the failure path:

* ``WorkerLiveness``: the workers' heartbeats at one moment. A holder (the Celery node that took a group or
  a train step) is known gone when its row says it stopped, restarted after it took the work, or went
  silent for ``TEMPER_WORKER_SILENT_SECONDS``.
* ``broker_was_reset``: a marker key in Redis vanishes with a Redis that restarted empty (``make run``'s
  embedded one always does): every queued message is gone.
* ``retry_after_failure``: a loop task raised (``workers.tasks.failures``); its work is handed out again
  after a backoff, unless the run failed of it (``services.do_record_task_failure``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from webapp.runs.loop.heartbeats import silent_seconds
from webapp.runs.models import PromptGroup, WorkerHeartbeat
from workers import messages

BROKER_EPOCH_KEY = "temper:broker-epoch"


@dataclass(frozen=True)
class WorkerLiveness:
    rows: dict[str, tuple[Any, Any, Any]]
    """node name -> (started_at, last_seen, stopped_at)"""
    silent_after: timedelta

    @classmethod
    def now(cls) -> WorkerLiveness:
        return cls({name: (started, seen, stopped) for name, started, seen, stopped in WorkerHeartbeat.objects
                    .values_list("name", "started_at", "last_seen", "stopped_at")},
                   timedelta(seconds=silent_seconds()))

    def gone(self, holder: str, since: Any) -> str | None:
        """Why ``holder``, which took its work at ``since``, is known gone (None while it may still work)."""
        if not holder:
            return None
        row = self.rows.get(holder)
        if row is None:
            return f"{holder} has no heartbeat"
        started, seen, stopped = row
        if stopped is not None and stopped >= since:
            return f"{holder} stopped"
        if started > since:
            return f"{holder} restarted"
        if seen < timezone.now() - self.silent_after:
            return f"{holder} went silent"
        return None


def broker_was_reset() -> bool:
    """True once after the broker lost its data. (On the very first tick the key is missing too; handing
    work out again then is harmless: every task is idempotent.)"""
    import redis

    try:
        return bool(redis.Redis.from_url(settings.REDIS_URL).set(BROKER_EPOCH_KEY, str(time.time()), nx=True))
    except redis.RedisError:
        return False


def release_generation(group_ids: list[int]) -> int | None:
    """Groups a failed generation task held go back to admitted (attempt + 1), to be generated again;
    the first group's new attempt (part of the new task's id), or None when none was still held."""
    with transaction.atomic():
        held = list(PromptGroup.objects.select_for_update().filter(
            pk__in=group_ids, status=PromptGroup.Status.GENERATING).order_by("id").values_list("id", "attempt"))
        if not held:
            return None
        PromptGroup.objects.filter(pk__in=[g for g, _ in held]).update(
            status=PromptGroup.Status.ADMITTED, attempt=held[0][1] + 1, holder="", updated_at=timezone.now())
    return held[0][1] + 1


def retry_after_failure(task_name: str, args: list[Any], count: int) -> None:
    """Hand a failed task's work out again after ``2 ** count`` seconds (at most 30)."""
    countdown = float(min(30, 2 ** count))
    if task_name == messages.GENERATE:
        run_id, group_ids = args[0], args[1]
        attempt = release_generation(group_ids)
        if attempt is not None:
            messages.generate(run_id, group_ids, attempt, countdown=countdown)
        return
    if task_name == messages.TRAIN_STEP:
        messages.train_step(args[0], args[1], countdown=countdown)
        return
    messages.retry(task_name, tuple(args), countdown)


def run_of_task(task_name: str, args: list[Any]) -> int | None:
    """The run a loop task works for (its first argument, or its group's run)."""
    if task_name == messages.VERIFY_GROUP and args:
        return PromptGroup.objects.filter(pk=args[0]).values_list("run_id", flat=True).first()
    if task_name in LOOP_TASKS and args and isinstance(args[0], int):
        return int(args[0])
    return None


LOOP_TASKS = frozenset({messages.ADVANCE_RUN, messages.REPORT_STEP, messages.GENERATE, messages.EVALUATE,
                        messages.TRAIN_STEP, messages.VERIFY_BATCH, messages.SCORE_EVALUATION})
