"""Metric events of a run: persisted in one batch with sequence numbers, then broadcast to the run page.

Every task emits its metrics in one call, so a run sends a handful of websocket messages a second at
most. channels_redis delivers at most once: the page notices a gap in ``seq`` and backfills over
``/api/v1/metrics/?since_seq=``. A broadcast failure (Redis away) never fails the task: the points are
already in the database, which is the source of truth.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from webapp.runs.metrics import Point, record_points

log = logging.getLogger(__name__)


def emit(run_id: int, points: Sequence[Point], *, event: dict[str, Any] | None = None) -> None:
    rows = record_points(run_id, points)
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
