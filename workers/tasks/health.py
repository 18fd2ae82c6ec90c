"""Liveness and run health: a ping per queue, worker heartbeats, and the alerts on a run's event log.

* ``ping``: a trivial task per queue, to check that a worker consumes it.
* Heartbeats: every worker process that consumes tasks runs a thread that upserts its
  ``WorkerHeartbeat`` row every ``TEMPER_HEARTBEAT_SECONDS`` (default 5) with its queues, its current
  task and its device-busy seconds; a clean shutdown marks the row stopped. A worker silent for more than
  ``TEMPER_WORKER_SILENT_SECONDS`` (default 30) is flagged on the active runs.
* ``check_run_health(run_id)``: gathers the facts ``workers.pipeline.health`` needs, raises the alerts that
  are new and clears the ones that recovered (``Run.state["alerts"]`` remembers what is raised, so each
  alert is logged once), and pauses the run on a collapse when its spec asks for it. Called after every
  train step and by the recovery tick.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import datetime, timedelta
from typing import Any

from celery import signals

from workers.celery import QUEUES, app

log = logging.getLogger(__name__)


@app.task(name="workers.tasks.health.ping")
def ping(payload: Any = None) -> dict[str, Any]:
    return {"pong": payload, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}


def ping_all(timeout: float = 10.0) -> dict[str, dict[str, Any]]:
    """Round-trip a ping through every queue; raises on the first queue that does not answer in time."""
    return {queue: ping.apply_async(args=[queue], queue=queue).get(timeout=timeout) for queue in QUEUES}


def this_worker() -> str:
    """The Celery node name of the worker running the current task (what its heartbeat row is named)."""
    from celery import current_task

    request = getattr(current_task, "request", None)
    return str(getattr(request, "hostname", "") or "")


def heartbeat_seconds() -> float:
    return float(os.environ.get("TEMPER_HEARTBEAT_SECONDS", "5"))


def silent_seconds() -> float:
    return float(os.environ.get("TEMPER_WORKER_SILENT_SECONDS", "30"))


# --- heartbeats ------------------------------------------------------------------------------------


class Heartbeat(threading.Thread):
    """Upserts this worker's row now and then every ``interval`` seconds until stopped."""

    current: tuple[str, int | None] = ("", None)  # (task name, run id) of the task this process runs

    def __init__(self, name: str, queues: list[str], interval: float) -> None:
        super().__init__(name="temper-heartbeat", daemon=True)
        self.node, self.queues, self.interval = name, ",".join(queues), interval
        self.started = datetime.now().astimezone()
        self.stopping = threading.Event()

    def beat(self, *, stopped: bool = False) -> None:
        from django.db import close_old_connections, connection
        from django.utils import timezone

        from webapp.runs.models import WorkerHeartbeat
        from workers.telemetry import busy_seconds

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
        from workers.policy.device import DeviceUnavailable
        from workers.tasks import resident

        try:
            return str(resident.placement().describe())
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


_heartbeat: Heartbeat | None = None


@signals.worker_ready.connect
def _start_heartbeat(sender: Any = None, **kwargs: Any) -> None:
    global _heartbeat
    queues = sorted(sender.app.amqp.queues.consume_from) if sender is not None else []
    _heartbeat = Heartbeat(getattr(sender, "hostname", socket.gethostname()), queues, heartbeat_seconds())
    _heartbeat.start()


@signals.worker_shutdown.connect
def _stop_heartbeat(**kwargs: Any) -> None:
    if _heartbeat is not None:
        _heartbeat.stop()


@signals.task_prerun.connect
def _task_started(task: Any = None, args: Any = None, **kwargs: Any) -> None:
    run_id = args[0] if task is not None and task.name.rsplit(".", 1)[-1] in (
        "advance_run", "generate", "evaluate", "train_step") and args else None
    Heartbeat.current = (getattr(task, "name", ""), run_id if isinstance(run_id, int) else None)


@signals.task_postrun.connect
def _task_finished(**kwargs: Any) -> None:
    Heartbeat.current = ("", None)


# --- run health ------------------------------------------------------------------------------------


def gather(run: Any, spec: Any, now: datetime) -> Any:
    """The facts ``workers.pipeline.health.check`` judges, read from the database."""
    from django.db.models import Min

    from webapp.runs.models import MetricPoint, PromptGroup, Trajectory, Verdict, WorkerHeartbeat
    from workers.pipeline.health import HealthFacts, StepFacts, WorkerFacts

    G = PromptGroup.Status
    window = spec.collapse_window
    names = ("zero_variance_share", "nonfinite", "staleness_max")
    rows = (MetricPoint.objects.filter(run=run, name__in=names, domain__isnull=True, step__gt=run.step - window)
            .values_list("step", "name", "value"))
    by_step: dict[int, dict[str, float]] = {}
    for step, name, value in rows:
        by_step.setdefault(step, {})[name] = value
    steps = [StepFacts(step=s, zero_variance_share=v.get("zero_variance_share"), nonfinite=bool(v.get("nonfinite")),
                       staleness_max=v.get("staleness_max")) for s, v in sorted(by_step.items())]
    verdicts = list(Trajectory.objects.filter(run=run, is_eval=False).exclude(verdict=Verdict.PENDING)
                    .order_by("-id").values_list("verdict", flat=True)[:200])
    groups = PromptGroup.objects.filter(run=run)
    ages: dict[str, float] = {}
    for stage, statuses in (("generate", [G.ADMITTED, G.GENERATING]), ("verify", [G.VERIFYING])):
        oldest = groups.filter(status__in=statuses).aggregate(t=Min("updated_at"))["t"]
        if oldest is not None:
            ages[stage] = (now - oldest).total_seconds()
    if claimed_at := run.state.get("train_claim_at"):
        ages["train"] = now.timestamp() - float(claimed_at)
    recent = list(groups.order_by("-id").values_list("drop_reason", flat=True)[: window * spec.pipeline.batch_prompts])
    active_since = run.started_at or now
    resumed = run.events.filter(kind="status.running").order_by("-id").values_list("created_at", flat=True).first()
    if resumed is not None and resumed > active_since:
        active_since = resumed
    workers = [
        WorkerFacts(name=w.name, queues=tuple(w.queue_list), silent_s=(now - w.last_seen).total_seconds(),
                    stopped=w.stopped_at is not None, seen_during_run=w.last_seen >= active_since)
        for w in WorkerHeartbeat.objects.filter(last_seen__gte=now - timedelta(days=1))
    ]
    return HealthFacts(
        steps=steps, judged=len(verdicts),
        invalid_share=sum(v == Verdict.INVALID for v in verdicts) / max(1, len(verdicts)),
        stage_age_s=ages, stale_dropped=sum(r.startswith("staler than") for r in recent), workers=workers,
    )


def check_run_health(run_id: int) -> list[str]:
    """Raise new alerts and clear recovered ones on a running run; returns the keys of the alerts active now."""
    from django.db import transaction
    from django.utils import timezone

    from webapp.runs import services
    from webapp.runs.models import Run, RunEvent, RunStatus
    from workers.pipeline import health
    from workers.pipeline.spec import RunSpec

    run = Run.objects.filter(pk=run_id, status=RunStatus.RUNNING).first()
    if run is None:
        return []
    spec = RunSpec.model_validate(run.spec)
    p = spec.pipeline
    bounds = health.Bounds(
        collapse_window=spec.collapse_window, max_invalid_rate=spec.invalid_rate_alert,
        staleness=spec.staleness_alert if spec.staleness_alert is not None else
        (0 if p.mode == "sync" else p.max_staleness),
        stale_drops=p.batch_prompts, stall_seconds=spec.stall_alert_seconds, silent_seconds=silent_seconds(),
    )
    current = health.check(gather(run, spec, timezone.now()), bounds)
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run_id)
        if run.status != RunStatus.RUNNING:
            return []
        active: dict[str, Any] = dict(run.state.get("alerts", {}))
        raised, cleared = health.changes(active, current)
        for alert in raised:
            event = services.record_event(run, alert.kind, alert.message, level=alert.level,
                                          data={**alert.data, "key": alert.key})
            active[alert.key] = {"kind": alert.kind, "level": alert.level, "event": event.pk,
                                 "since": event.created_at.isoformat()}
        for key in cleared:
            kind = active.pop(key)["kind"]
            services.record_event(run, f"{kind}.cleared", f"recovered: {key}", level=RunEvent.Level.INFO,
                                  data={"key": key})
        if raised or cleared:
            Run.objects.filter(pk=run_id).update(state={**run.state, "alerts": active})
            run.state["alerts"] = active
        if spec.auto_pause_on_collapse and any(a.key == "collapse" for a in raised):
            services.do_pause_run(run, reason="training collapsed (auto_pause_on_collapse)")
    return sorted(active)
