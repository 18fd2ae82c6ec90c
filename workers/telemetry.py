"""Metric events of a run: persisted in one batch with sequence numbers, then broadcast to the run page.

Every task emits its metrics in one call, so a run sends a handful of websocket messages a second at
most. channels_redis delivers at most once: the page notices a gap in ``seq`` and backfills over
``/api/v1/metrics/?since_seq=``. A broadcast failure (Redis away) never fails the task: the points are
already in the database, which is the source of truth.

Messages sent to the channel group ``run.<id>`` (the websocket consumer forwards them as they are):

* ``{"type": "metrics", "points": [[name, domain_id, step, value, seq], ...], "first_seq", "last_seq"}``,
  optionally with ``"event"``: a batch of metric points.
* ``{"type": "event", "event": {"id", "kind", "level", "message", "data", "created_at"}}``: a new line of
  the run's event log (``GET /api/v1/runs/<id>/events/``), sent after commit. Alerts have kinds
  ``alert.<what>`` (``collapse``, ``stall``, ``invalid_rate``, ``staleness``, ``worker_gone``,
  ``no_worker``) with level ``warning``/``error``; ``alert.<what>.cleared`` (level ``info``) says it
  recovered. ``data["key"]`` names the alert (``stall.verify``, ``worker_gone:gpu@host``, …).
* ``{"type": "run", "status", "status_reason", "step", "latest_version"}``: the run changed state.

GPU-busy time: ``busy(run_id)`` times device work (generating, training, switching or saving weights).
It is added to the process's total (reported with the worker's heartbeat, hence per GPU worker) and to
the run's counter in Redis, which each train step turns into the ``gpu_busy`` point: busy seconds since
the previous step over the wall seconds between the two steps.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from webapp.runs.metrics import Point, record_points

log = logging.getLogger(__name__)


def emit(run_id: int, points: Sequence[Point], *, event: dict[str, Any] | None = None) -> None:
    # JSON has no NaN or infinity: a non-finite value is left out (the trainer reports it as a collapse)
    rows = record_points(run_id, [p for p in points if math.isfinite(p.value)])
    payload: dict[str, Any] = {
        "type": "metrics",
        "points": [[r.name, r.domain_id, r.step, r.value, r.seq] for r in rows],
        "first_seq": rows[0].seq if rows else None,
        "last_seq": rows[-1].seq if rows else None,
    }
    if event:
        payload["event"] = event
    broadcast(run_id, payload)


def broadcast(run_id: int, payload: dict[str, Any]) -> None:
    try:
        from asgiref.sync import async_to_sync
        from channels.layers import get_channel_layer

        layer = get_channel_layer()
        if layer is not None:
            async_to_sync(layer.group_send)(f"run.{run_id}", {"type": "run.update", "payload": payload})
    except Exception as exc:  # the page backfills from the database
        log.warning("broadcast to run %s failed: %s", run_id, exc)


def event_payload(event: Any) -> dict[str, Any]:
    """A RunEvent as the ``{"type": "event"}`` message."""
    return {"type": "event", "event": {
        "id": event.pk, "kind": event.kind, "level": event.level, "message": event.message, "data": event.data,
        "created_at": event.created_at.isoformat() if event.created_at else None,
    }}


def run_payload(run: Any) -> dict[str, Any]:
    """A run's state as the ``{"type": "run"}`` message."""
    return {"type": "run", "status": run.status, "status_reason": run.status_reason, "step": run.step,
            "latest_version": run.latest_version}


# --- GPU-busy time ---------------------------------------------------------------------------------

_busy_lock = threading.Lock()
_busy_total = 0.0


@dataclass
class Timer:
    seconds: float = 0.0


@contextmanager
def busy(run_id: int | None) -> Iterator[Timer]:
    """Time a stretch of device work for this worker process and for the run."""
    global _busy_total
    timer = Timer()
    started = time.monotonic()
    try:
        yield timer
    finally:
        timer.seconds = time.monotonic() - started
        with _busy_lock:
            _busy_total += timer.seconds
        if run_id is not None:
            from webapp.runs.pipeline import add_busy

            add_busy(run_id, timer.seconds)


def busy_seconds() -> float:
    """Device seconds this worker process has spent since it started (sent with its heartbeat)."""
    with _busy_lock:
        return _busy_total
