"""Liveness: a ping per queue, and the Celery signals that keep this worker's heartbeat row
(``webapp.runs.loop.heartbeats``)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from celery import current_task, signals

from webapp.runs.loop import heartbeats
from workers.celery import QUEUES, app


@app.task(name="workers.tasks.health.ping")
def ping(payload: Any = None) -> dict[str, Any]:
    return {"pong": payload, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}


def ping_all(timeout: float = 10.0) -> dict[str, dict[str, Any]]:
    """Round-trip a ping through every queue; raises on the first queue that does not answer in time."""
    return {queue: ping.apply_async(args=[queue], queue=queue).get(timeout=timeout) for queue in QUEUES}


def this_worker() -> str:
    """The Celery node name of the worker running the current task (what its heartbeat row is named)."""
    return str(getattr(getattr(current_task, "request", None), "hostname", "") or "")


_heartbeat: heartbeats.Heartbeat | None = None
_RUN_TASKS = ("advance_run", "generate", "evaluate", "train_step")


@signals.worker_ready.connect
def _start_heartbeat(sender: Any = None, **kwargs: Any) -> None:
    global _heartbeat
    queues = sorted(sender.app.amqp.queues.consume_from) if sender is not None else []
    _heartbeat = heartbeats.Heartbeat(getattr(sender, "hostname", socket.gethostname()), queues,
                                      heartbeats.heartbeat_seconds())
    _heartbeat.start()


@signals.worker_shutdown.connect
def _stop_heartbeat(**kwargs: Any) -> None:
    if _heartbeat is not None:
        _heartbeat.stop()


@signals.task_prerun.connect
def _task_started(task: Any = None, args: Any = None, **kwargs: Any) -> None:
    run_id = args[0] if task is not None and task.name.rsplit(".", 1)[-1] in _RUN_TASKS and args else None
    heartbeats.Heartbeat.current = (getattr(task, "name", ""), run_id if isinstance(run_id, int) else None)


@signals.task_postrun.connect
def _task_finished(**kwargs: Any) -> None:
    heartbeats.Heartbeat.current = ("", None)
