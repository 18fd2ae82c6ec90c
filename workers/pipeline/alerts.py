"""Run alerts: from a few facts about a run right now, the alerts that hold. Pure: no Django, no Celery.

Alerts, each with a stable key so it is raised once and cleared when the condition is gone:

* ``collapse``: every group's rewards were identical in each of the last ``collapse_window`` steps (no
  learning signal: the policy may answer everything the same way), or the latest step's loss or gradient
  was NaN/inf (the optimizer step was skipped). Level error.
* ``stall.<stage>``: a stage (``generate``, ``verify``, ``train``) has held its oldest work longer than
  ``stall_seconds``. The recovery tick re-issues lost work after ``TEMPER_STALL_SECONDS``; this says it did
  not help, or the stage is just that slow. Level warning.
* ``invalid_rate``: more than ``max_invalid_rate`` of the latest verdicts are invalid (the verifier cannot
  judge: a crash, a timeout, an unusable reference). Level warning.
* ``staleness``: the latest step trained samples more versions old than the bound, or more than a batch of
  groups was dropped as too stale lately (their generation or judging outlasted ``max_staleness`` steps: a
  slow judge's tail is overtaken by later groups). Level warning.
* ``worker_gone:<name>``: a worker that was alive while the run was active stopped sending heartbeats
  without a clean shutdown. Level warning.
* ``no_worker:<queue>``: no live worker consumes a queue the run needs. Level error.
* ``starved``: the run has admitted nothing new for longer than ``starved_seconds`` because other runs on
  the same workers were behind their shares (``scheduler.Share``): its share may be too small for the load.
  Level warning.

``changes(active, now)`` compares with the alerts already raised (kept on the run), so each is logged once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

QUEUES = ("control", "rollout", "train", "verify")


@dataclass(frozen=True)
class StepFacts:
    step: int
    zero_variance_share: float | None = None
    nonfinite: bool = False
    staleness_max: float | None = None


@dataclass(frozen=True)
class WorkerFacts:
    name: str
    queues: tuple[str, ...]
    silent_s: float
    """Seconds since its last heartbeat."""
    stopped: bool = False
    """It shut down cleanly (a person or a deploy stopped it)."""
    seen_during_run: bool = True
    """It sent a heartbeat after the run last started or resumed."""


@dataclass(frozen=True)
class HealthFacts:
    steps: Sequence[StepFacts] = ()
    """The latest train steps, oldest first."""
    judged: int = 0
    """How many of the latest verdicts ``invalid_share`` is taken over."""
    invalid_share: float = 0.0
    stage_age_s: Mapping[str, float] = field(default_factory=dict)
    """Stage -> seconds its oldest waiting work has waited (stages with nothing waiting are absent)."""
    stale_dropped: int = 0
    """Groups dropped as too stale among the latest ones."""
    workers: Sequence[WorkerFacts] = ()
    deferred_s: float = 0.0
    """Seconds the run has been held back for other runs' shares (0 when it is not)."""


@dataclass(frozen=True)
class Bounds:
    collapse_window: int = 20
    max_invalid_rate: float = 0.2
    min_judged: int = 20
    """Fewer verdicts than this say nothing about the invalid rate yet."""
    staleness: int = 1
    stale_drops: int = 16
    stall_seconds: float = 180.0
    silent_seconds: float = 30.0
    starved_seconds: float = 180.0
    queues: tuple[str, ...] = QUEUES


@dataclass(frozen=True)
class Alert:
    key: str
    kind: str
    level: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)


STAGE_NAMES = {"generate": "generation", "verify": "verification", "train": "training"}


def check(facts: HealthFacts, bounds: Bounds) -> list[Alert]:
    """Every alert whose condition holds now."""
    alerts: list[Alert] = []
    latest = facts.steps[-1] if facts.steps else None
    window = list(facts.steps)[-bounds.collapse_window:]
    if latest is not None and latest.nonfinite:
        alerts.append(Alert("collapse", "alert.collapse", "error",
                            f"training collapsed at step {latest.step}: non-finite loss or gradient "
                            "(the optimizer step was skipped)", {"step": latest.step, "reason": "nonfinite"}))
    elif len(window) >= bounds.collapse_window and all(
            s.zero_variance_share is not None and s.zero_variance_share >= 1.0 for s in window):
        alerts.append(Alert("collapse", "alert.collapse", "error",
                            f"training collapsed: every group's rewards were identical in each of the last "
                            f"{len(window)} steps (steps {window[0].step}-{window[-1].step}): no learning signal",
                            {"step": window[-1].step, "reason": "zero_variance", "steps": len(window)}))
    for stage, age in sorted(facts.stage_age_s.items()):
        if age > bounds.stall_seconds:
            alerts.append(Alert(f"stall.{stage}", "alert.stall", "warning",
                                f"{STAGE_NAMES.get(stage, stage)} stalled: its oldest work has waited {age:.0f} s "
                                f"(bound {bounds.stall_seconds:.0f} s)", {"stage": stage, "seconds": round(age, 1)}))
    if facts.judged >= bounds.min_judged and facts.invalid_share > bounds.max_invalid_rate:
        alerts.append(Alert("invalid_rate", "alert.invalid_rate", "warning",
                            f"{facts.invalid_share:.0%} of the latest {facts.judged} verdicts are invalid "
                            f"(bound {bounds.max_invalid_rate:.0%}): the verifier cannot judge them",
                            {"share": round(facts.invalid_share, 4), "judged": facts.judged}))
    if latest is not None and latest.staleness_max is not None and latest.staleness_max > bounds.staleness:
        alerts.append(Alert("staleness", "alert.staleness", "warning",
                            f"step {latest.step} trained samples {latest.staleness_max:.0f} versions old "
                            f"(bound {bounds.staleness})", {"step": latest.step, "lag": latest.staleness_max}))
    elif facts.stale_dropped > bounds.stale_drops:
        alerts.append(Alert("staleness", "alert.staleness", "warning",
                            f"{facts.stale_dropped} recent groups were dropped as too stale: their generation "
                            "or judging outlasted max_staleness steps (raise it, or shorten the verifier's tail)",
                            {"dropped": facts.stale_dropped}))
    if facts.deferred_s > bounds.starved_seconds:
        alerts.append(Alert("starved", "alert.starved", "warning",
                            f"the run has waited {facts.deferred_s:.0f} s for its share of the shared workers "
                            f"(bound {bounds.starved_seconds:.0f} s): raise its share or add workers",
                            {"seconds": round(facts.deferred_s, 1)}))
    live: set[str] = set()
    for w in facts.workers:
        if not w.stopped and w.silent_s <= bounds.silent_seconds:
            live.update(w.queues)
    for w in facts.workers:
        if w.seen_during_run and not w.stopped and w.silent_s > bounds.silent_seconds:
            alerts.append(Alert(f"worker_gone:{w.name}", "alert.worker_gone", "warning",
                                f"worker {w.name} ({', '.join(w.queues)}) has been silent for {w.silent_s:.0f} s",
                                {"worker": w.name, "queues": list(w.queues), "silent_s": round(w.silent_s, 1)}))
    for queue in bounds.queues:
        if queue not in live:
            alerts.append(Alert(f"no_worker:{queue}", "alert.no_worker", "error",
                                f"no live worker consumes the {queue} queue: the run cannot progress",
                                {"queue": queue}))
    return alerts


def changes(active: Mapping[str, Any], current: Sequence[Alert]) -> tuple[list[Alert], list[str]]:
    """(alerts to raise: new keys, keys to clear: active ones whose condition is gone)."""
    now = {a.key for a in current}
    return [a for a in current if a.key not in active], [k for k in active if k not in now]
