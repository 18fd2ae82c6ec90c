"""What a run's page hears live: typed websocket payloads, one send helper, and the device-busy clock.

Every message sent to the channel group ``run.<id>`` is one of the ``TypedDict``s below (a ``Literal``
``type`` each, unioned in ``Payload``), built by a function here and sent through ``send`` — so mypy checks
every broadcast, and ``webapp/static/temper/run.js`` documents the same three shapes. channels_redis
delivers at most once: the page notices a gap in ``seq`` and backfills over
``/api/v1/metrics/?since_seq=``. A send that fails (Redis away) never fails the work: the points are
already in the database, the source of truth.

GPU-busy time: ``busy(run_id)`` times device work (generating, training, switching or saving weights). It
is added to the process's total (reported with the worker's heartbeat, hence per GPU worker), to the run's
step counter in Redis (each train step turns it into the ``gpu_busy`` point: busy seconds since the
previous step over the wall seconds between the two) and to the run's recent usage, decayed over a minute
(the fair share between runs, ``scheduler.Share``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from django.conf import settings

from webapp.runs.metrics import Point, record_points
from workers import profiling
from workers.policy import resident

log = logging.getLogger(__name__)


class MetricsPayload(TypedDict):
    """A batch of metric points: ``[name, domain_id, step, value, seq]`` each."""

    type: Literal["metrics"]
    points: list[list[Any]]
    first_seq: int | None
    last_seq: int | None


class EventBody(TypedDict):
    id: int
    kind: str
    level: str
    message: str
    data: dict[str, Any]
    created_at: str | None


class EventPayload(TypedDict):
    """A new line of the run's event log (``GET /api/v1/runs/<id>/events/``), sent after commit. Alerts have
    kinds ``alert.<what>`` (level warning/error) and ``alert.<what>.cleared`` (info)."""

    type: Literal["event"]
    event: EventBody


class RunPayload(TypedDict):
    """The run changed state."""

    type: Literal["run"]
    status: str
    status_reason: str
    step: int
    latest_version: int


Payload = MetricsPayload | EventPayload | RunPayload


def send(run_id: int, payload: Payload) -> None:
    """The one way a payload reaches ``run.<id>`` (the websocket consumer forwards it as it is)."""
    try:
        from asgiref.sync import async_to_sync
        from channels.layers import get_channel_layer

        layer = get_channel_layer()
        if layer is not None:
            with profiling.timed("redis"):
                async_to_sync(layer.group_send)(f"run.{run_id}", {"type": "run.update", "payload": payload})
    except Exception as exc:  # the page backfills from the database
        log.warning("broadcast to run %s failed: %s", run_id, exc)


def emit(run_id: int, points: Sequence[Point]) -> None:
    """Persist points in one batch (sequence numbers per run), then send them in one message."""
    # JSON has no NaN or infinity: a non-finite value is left out (the trainer reports it as a collapse)
    rows = record_points(run_id, [p for p in points if math.isfinite(p.value)])
    send(run_id, {"type": "metrics", "points": [[r.name, r.domain_id, r.step, r.value, r.seq] for r in rows],
                  "first_seq": rows[0].seq if rows else None, "last_seq": rows[-1].seq if rows else None})


def event_payload(event: Any) -> EventPayload:
    return {"type": "event", "event": {
        "id": event.pk, "kind": event.kind, "level": event.level, "message": event.message, "data": event.data,
        "created_at": event.created_at.isoformat() if event.created_at else None}}


def run_payload(run: Any) -> RunPayload:
    return {"type": "run", "status": run.status, "status_reason": run.status_reason, "step": run.step,
            "latest_version": run.latest_version}


# ---------------------------------------------------------------- device-busy time

_busy_lock = threading.Lock()
_busy_total = 0.0


@dataclass
class Timer:
    seconds: float = 0.0


_client: Any = None


def _redis() -> Any:
    """One client per process (its pool reuses connections: a client per call opened a connection per
    device stretch)."""
    global _client
    if _client is None:
        import redis

        _client = redis.Redis.from_url(settings.REDIS_URL)
    return _client


@contextmanager
def busy(run_id: int | None) -> Iterator[Timer]:
    """Time a stretch of device work for this worker process and for the run."""
    timer = Timer()
    started, cpu = resident.device_time()
    try:
        yield timer
    finally:
        ended, cpu_ended = resident.device_time()
        timer.seconds = ended - started
        account_busy(run_id, timer.seconds, cpu_ended - cpu)


def account_busy(run_id: int | None, seconds: float, cpu: float) -> None:
    """Count ``seconds`` of device work (``cpu`` of them on a CPU: less than the wall when the device
    waited) for this worker process and the run: ``busy``'s accounting, for a stretch timed elsewhere (a
    step trained ahead, timed by the device process)."""
    global _busy_total
    profiling.add("device", seconds)
    profiling.add("device_cpu", cpu)
    with _busy_lock:
        _busy_total += seconds
    if run_id is not None:
        try:
            with profiling.timed("redis"), _redis().pipeline(transaction=False) as pipe:  # one round trip
                pipe.incrbyfloat(f"temper:run:{run_id}:busy", seconds)
                pipe.eval(_DECAYED_ADD, 1, _usage_key(run_id), time.time(), seconds, USAGE_TAU_S)
                pipe.execute()
        except Exception:  # telemetry must never fail the work
            pass


@contextmanager
def on_device(run_id: int | None) -> Iterator[Timer]:
    """Hold the device for a stretch of work (generating, training, switching or saving weights); the time
    it is held counts as GPU-busy for this worker and the run. Engines and trainers are only used inside.
    With a device process, its queue holds the device, and the time is what it reports for the stretch's
    requests (``resident.device_time``)."""
    with resident.holding_device(), busy(run_id) as timer:
        yield timer


def busy_seconds() -> float:
    """Device seconds this worker process has spent since it started (sent with its heartbeat)."""
    with _busy_lock:
        return _busy_total


def take_busy(run_id: int) -> float:
    """The run's busy seconds since the last call (reset atomically): the ``gpu_busy`` point's numerator."""
    try:
        return float(_redis().getdel(f"temper:run:{run_id}:busy") or 0.0)
    except Exception:
        return 0.0


USAGE_TAU_S = 60.0
"""Device time counts for the fair share with an exponential decay of this time constant: what a run used
a minute ago weighs 1/e of what it uses now, so a run that joins late is not owed the whole history."""

# usage = usage * exp(-(now - then) / tau) + seconds, kept with the time it was last updated
_DECAYED_ADD = """
local now, add, tau = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local v = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
local t = tonumber(redis.call('HGET', KEYS[1], 't') or ARGV[1])
v = v * math.exp(-(now - t) / tau) + add
redis.call('HSET', KEYS[1], 'v', tostring(v), 't', ARGV[1])
redis.call('EXPIRE', KEYS[1], 86400)
return tostring(v)
"""


def _usage_key(run_id: int) -> str:
    return f"temper:run:{run_id}:usage"


def device_seconds(run_ids: Sequence[int]) -> dict[int, float]:
    """Each run's recent device seconds (decayed, ``USAGE_TAU_S``): its fair share's measure; 0 where
    Redis has none."""
    if not run_ids:
        return {}
    now = time.time()
    try:
        client = _redis()
        with client.pipeline(transaction=False) as pipe:
            for r in run_ids:
                pipe.hmget(_usage_key(r), "v", "t")
            rows = pipe.execute()
    except Exception:
        return dict.fromkeys(run_ids, 0.0)
    out = {}
    for r, (v, t) in zip(run_ids, rows, strict=True):
        out[r] = float(v) * math.exp(-(now - float(t)) / USAGE_TAU_S) if v is not None and t is not None else 0.0
    return out


def forget_usage(run_id: int) -> None:
    """A run that starts for the first time has used nothing (its id may have been another run's)."""
    with contextlib.suppress(Exception):
        _redis().delete(_usage_key(run_id), f"temper:run:{run_id}:busy")
