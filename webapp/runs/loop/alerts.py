"""A run's health, the database half: the facts the pure rules (``workers.pipeline.alerts``) judge, and the
alerts they raise or clear on the run's event log (each raised once: ``Run.state["alerts"]`` remembers).

Called after every train step (``reporting``) and by the recovery tick. A collapse pauses the run when its
spec asks for it.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Min
from django.utils import timezone

from webapp.runs import services
from webapp.runs.loop.heartbeats import silent_seconds
from webapp.runs.models import (
    MetricPoint,
    PromptGroup,
    Run,
    RunEvent,
    RunStatus,
    Trajectory,
    VerdictChoice,
    WorkerHeartbeat,
)
from workers.pipeline import alerts as rules
from workers.pipeline.alerts import HealthFacts, StepFacts, WorkerFacts
from workers.pipeline.scheduler import STALE
from workers.pipeline.spec import RunSpec

G = PromptGroup.Status


def gather(run: Run, spec: RunSpec, now: datetime) -> HealthFacts:
    """The facts ``workers.pipeline.alerts.check`` judges, read from the database."""
    window = spec.collapse_window
    names = ("zero_variance_share", "nonfinite", "staleness_max")
    rows = (MetricPoint.objects.filter(run=run, name__in=names, domain__isnull=True, step__gt=run.step - window)
            .values_list("step", "name", "value"))
    by_step: dict[int, dict[str, float]] = {}
    for step, name, value in rows:
        by_step.setdefault(step, {})[name] = value
    steps = [StepFacts(step=s, zero_variance_share=v.get("zero_variance_share"), nonfinite=bool(v.get("nonfinite")),
                       staleness_max=v.get("staleness_max")) for s, v in sorted(by_step.items())]
    verdicts = list(Trajectory.objects.filter(run=run, is_eval=False).exclude(verdict=VerdictChoice.PENDING)
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
        invalid_share=sum(v == VerdictChoice.INVALID for v in verdicts) / max(1, len(verdicts)),
        stage_age_s=ages, stale_dropped=sum(r.startswith(STALE) for r in recent), workers=workers,
        deferred_s=now.timestamp() - float(run.state["deferred_since"]) if run.state.get("deferred_since") else 0.0,
    )


def check_run(run_id: int) -> list[str]:
    """Raise new alerts and clear recovered ones on a running run; returns the keys of the alerts active now."""
    run = Run.objects.filter(pk=run_id, status=RunStatus.RUNNING).first()
    if run is None:
        return []
    spec = RunSpec.model_validate(run.spec)
    p = spec.pipeline
    bounds = rules.Bounds(
        collapse_window=spec.collapse_window, max_invalid_rate=spec.invalid_rate_alert,
        staleness=spec.staleness_alert if spec.staleness_alert is not None else
        (0 if p.mode == "sync" else p.max_staleness),
        stale_drops=p.batch_prompts, stall_seconds=spec.stall_alert_seconds, silent_seconds=silent_seconds(),
        starved_seconds=spec.stall_alert_seconds,
    )
    current = rules.check(gather(run, spec, timezone.now()), bounds)
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run_id)
        if run.status != RunStatus.RUNNING:
            return []
        active: dict[str, Any] = dict(run.state.get("alerts", {}))
        raised, cleared = rules.changes(active, current)
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
