"""Worker heartbeats: every worker process that consumes tasks runs a thread that upserts its
``WorkerHeartbeat`` row every ``TEMPER_HEARTBEAT_SECONDS`` (default 5) with its queues, its current task,
its device-busy seconds and (a GPU worker) its device; a clean shutdown marks the row stopped. A worker
silent for more than ``TEMPER_WORKER_SILENT_SECONDS`` (default 30) is gone: flagged on the active runs
(``alerts``), and the work it held is handed out again (``recovery.WorkerLiveness``).

The Celery signals that start and stop the thread are ``workers.tasks.health``'s.
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import datetime

from django.db import close_old_connections, connection
from django.utils import timezone

from webapp.runs.loop.live import busy_seconds
from webapp.runs.models import WorkerHeartbeat

log = logging.getLogger(__name__)


def heartbeat_seconds() -> float:
    return float(os.environ.get("TEMPER_HEARTBEAT_SECONDS", "5"))


def silent_seconds() -> float:
    return float(os.environ.get("TEMPER_WORKER_SILENT_SECONDS", "30"))


class Heartbeat(threading.Thread):
    """Upserts this worker's row now and then every ``interval`` seconds until stopped."""

    current: tuple[str, int | None] = ("", None)  # (task name, run id) of the task this process runs

    def __init__(self, name: str, queues: list[str], interval: float) -> None:
        super().__init__(name="temper-heartbeat", daemon=True)
        self.node, self.queues, self.interval = name, ",".join(queues), interval
        self.started = datetime.now().astimezone()
        self.stopping = threading.Event()

    def beat(self, *, stopped: bool = False) -> None:
        close_old_connections()
        task, run_id = Heartbeat.current
        try:
            WorkerHeartbeat.objects.update_or_create(name=self.node, defaults={
                "queues": self.queues, "pid": os.getpid(), "started_at": self.started, "last_seen": timezone.now(),
                "stopped_at": timezone.now() if stopped else None, "busy_seconds": busy_seconds(),
                "current_task": task, "current_run": run_id, "device": self.device()})
        except Exception as exc:  # the database is away for a moment: the next beat tries again
            log.warning("heartbeat of %s failed: %s", self.node, exc)
            connection.close()

    def device(self) -> str:
        """A GPU worker's placement (``TEMPER_DEVICE`` resolved), or what stops it; empty for other workers."""
        if not {"rollout", "train"} & set(self.queues.split(",")):
            return ""
        from workers.policy import resident
        from workers.policy.device import DeviceUnavailable

        try:
            where = resident.placement(wait=False)  # None while its device process starts
            return str(where.describe()) if where is not None else ""
        except DeviceUnavailable as exc:
            return f"unavailable: {exc}"[:200]

    def run(self) -> None:
        while True:
            self.beat()
            if self.stopping.wait(self.interval):
                return

    def stop(self) -> None:
        self.stopping.set()
        self.join(5)
        self.beat(stopped=True)


