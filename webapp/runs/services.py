"""Every state change of a run and its policy versions, each a named function.

Transitions are conditional UPDATEs (``WHERE status IN allowed``), so two concurrent requests can never
both succeed, and each one writes an event to the run's log. Work is enqueued only after commit.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import transaction
from django.utils import timezone
from pydantic import ValidationError

from webapp.catalog.models import BaseModel, TaskDomain
from webapp.common.errors import InvalidTransition, ValidationFailed
from webapp.runs.loop import live
from webapp.runs.models import (
    ACTIVE_STATUSES,
    Alias,
    AliasEvent,
    PolicyVersion,
    Run,
    RunDomain,
    RunEvent,
    RunStatus,
)
from workers import messages
from workers.pipeline.spec import RunSpec, validation_messages

log = logging.getLogger(__name__)
User = AbstractBaseUser | AnonymousUser | None

# action -> (states it may start from, state it moves to)
TRANSITIONS: dict[str, tuple[frozenset[str], str]] = {
    "start": (frozenset({RunStatus.DRAFT}), RunStatus.QUEUED),
    "pause": (frozenset({RunStatus.QUEUED, RunStatus.RUNNING}), RunStatus.PAUSING),
    "resume": (frozenset({RunStatus.PAUSED}), RunStatus.QUEUED),
    "cancel": (
        frozenset({RunStatus.DRAFT, RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.PAUSING, RunStatus.PAUSED}),
        RunStatus.CANCELLED,
    ),
    # internal moves made by the control worker
    "begin": (frozenset({RunStatus.QUEUED}), RunStatus.RUNNING),
    "paused": (frozenset({RunStatus.PAUSING}), RunStatus.PAUSED),
    "complete": (frozenset({RunStatus.RUNNING, RunStatus.PAUSING}), RunStatus.COMPLETED),
    "fail": (frozenset(ACTIVE_STATUSES | {RunStatus.PAUSED}), RunStatus.FAILED),
}


@dataclass(frozen=True)
class DomainWeight:
    domain: TaskDomain
    weight: float = 1.0
    priority: int = 0


def _actor(user: User) -> Any:
    return user if user is not None and user.is_authenticated else None


def check_run_spec(spec: dict[str, Any] | None) -> RunSpec:
    """Validate a run spec, raising ``ValidationFailed`` with one message per bad field."""
    try:
        return RunSpec.model_validate(spec or {})
    except ValidationError as exc:
        raise ValidationFailed("the run spec is invalid", details=validation_messages(exc)) from None


def record_event(
    run: Run | int, kind: str, message: str, *, level: str = RunEvent.Level.INFO,
    data: dict[str, Any] | None = None, actor: User = None,
) -> RunEvent:
    """Append a line to the run's event log; the run page gets it as a ``{"type": "event"}`` message after commit."""
    run_id = run if isinstance(run, int) else run.pk
    event = RunEvent.objects.create(
        run_id=run_id, kind=kind, message=message, level=level, data=data or {}, actor=_actor(actor)
    )
    transaction.on_commit(partial(_broadcast_event, run_id, event))
    return event


def _broadcast_event(run_id: int, event: RunEvent) -> None:
    live.send(run_id, live.event_payload(event))


def _broadcast_run(run_id: int) -> None:
    run = Run.objects.filter(pk=run_id).first()
    if run is not None:
        live.send(run_id, live.run_payload(run))


def do_create_run(
    owner: Any, *, name: str, base_model: BaseModel, domains: Sequence[DomainWeight],
    engine: str = "torch", spec: dict[str, Any] | None = None, description: str = "",
) -> Run:
    """Create a draft run after validating its spec and domains."""
    run_spec = check_run_spec(spec)
    problems: dict[str, list[str]] = {}
    if not domains:
        problems["domains"] = ["a run needs at least one domain"]
    seen: set[int] = set()
    for item in domains:
        if item.weight <= 0:
            problems.setdefault("domains", []).append(f"domain {item.domain.name!r}: weight must be > 0")
        if item.domain.pk in seen:
            problems.setdefault("domains", []).append(f"domain {item.domain.name!r} is listed twice")
        seen.add(item.domain.pk)
    if problems:
        raise ValidationFailed("the run is invalid", details=problems)
    with transaction.atomic():
        run = Run.objects.create(
            owner=owner, name=name, base_model=base_model, engine=engine,
            spec=run_spec.model_dump(mode="json"), description=description,
        )
        RunDomain.objects.bulk_create(
            [RunDomain(run=run, domain=d.domain, weight=d.weight, priority=d.priority) for d in domains]
        )
        record_event(run, "created", f"run created with {len(domains)} domain(s)", actor=owner)
    return run


def _transition(run: Run, action: str, *, actor: User = None, reason: str = "", **updates: Any) -> Run:
    allowed, target = TRANSITIONS[action]
    now = timezone.now()
    fields: dict[str, Any] = {"status": target, "updated_at": now, **updates}
    if target == RunStatus.RUNNING and run.started_at is None:
        fields["started_at"] = now
    if target in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED):
        fields["finished_at"] = now
    fields["status_reason"] = reason  # why it is in this state now (a resumed run forgets why it paused)
    with transaction.atomic():
        changed = Run.objects.filter(pk=run.pk, status__in=allowed).update(**fields)
        if not changed:
            current = Run.objects.filter(pk=run.pk).values_list("status", flat=True).first()
            raise InvalidTransition(
                f"cannot {action} run {run.pk}: it is {current or 'gone'}, and {action} needs one of "
                f"{', '.join(sorted(allowed))}",
                details={"status": current, "action": action, "allowed_from": sorted(allowed)},
            )
        message = f"{action}: {run.status} → {target}" + (f" ({reason})" if reason else "")
        record_event(run, f"status.{target}", message, actor=actor,
                     level=RunEvent.Level.ERROR if target == RunStatus.FAILED else RunEvent.Level.INFO,
                     data={"from": run.status, "to": target, "action": action})
        transaction.on_commit(partial(_broadcast_run, run.pk))
    run.refresh_from_db()
    return run


def _enqueue_advance(run: Run) -> None:
    transaction.on_commit(partial(messages.advance_run, run.pk))


def uncalibrated_domains(run: Run) -> list[str]:
    """Names of the run's domains whose verifier has no passing calibration (the start gate)."""
    problems = []
    for rd in run.run_domains.select_related("domain__verifier"):
        verifier = rd.domain.verifier
        if verifier is None:
            problems.append(f"{rd.domain.name}: no verifier")
        elif not verifier.calibrated:
            problems.append(f"{rd.domain.name}: verifier {verifier.name!r} is {verifier.get_calibration_status_display()}")
    return problems


def do_start_run(run: Run, *, actor: User = None, force: bool = False) -> Run:
    """draft → queued. Refuses domains whose verifier has not passed calibration unless ``force``."""
    problems = uncalibrated_domains(run)
    if problems and not force:
        raise InvalidTransition(
            "cannot start: a verifier must pass calibration before its domain trains ("
            + "; ".join(problems)
            + "). Calibrate it (POST /api/v1/verifiers/{id}/calibrate/) or start with force=true.",
            details={"uncalibrated": problems},
        )
    with transaction.atomic():
        run = _transition(run, "start", actor=actor, forced_start=bool(problems))
        if problems:
            record_event(run, "forced_start", "started without passing calibration: " + "; ".join(problems),
                         level=RunEvent.Level.WARNING, actor=actor, data={"uncalibrated": problems})
        _enqueue_advance(run)
    return run


def do_pause_run(run: Run, *, actor: User = None, reason: str = "") -> Run:
    """queued/running → pausing; the control worker moves it to paused once in-flight work is saved."""
    with transaction.atomic():
        run = _transition(run, "pause", actor=actor, reason=reason)
        _enqueue_advance(run)
    return run


def do_resume_run(run: Run, *, actor: User = None) -> Run:
    """paused → queued; the control worker continues from the saved state."""
    with transaction.atomic():
        run = _transition(run, "resume", actor=actor)
        _enqueue_advance(run)
    return run


def do_cancel_run(run: Run, *, actor: User = None, reason: str = "cancelled by user") -> Run:
    with transaction.atomic():
        run = _transition(run, "cancel", actor=actor, reason=reason)
        _enqueue_advance(run)
    return run


def do_mark_running(run: Run) -> Run:
    return _transition(run, "begin")


def do_mark_paused(run: Run) -> Run:
    return _transition(run, "paused")


def do_complete_run(run: Run, reason: str = "") -> Run:
    return _transition(run, "complete", reason=reason)


def do_fail_run(run: Run, reason: str) -> Run:
    """→ failed, with the reason; the control worker then revokes the run's queued work and drops the rest."""
    with transaction.atomic():
        run = _transition(run, "fail", reason=reason)
        _enqueue_advance(run)
    return run


def failure_signature(task: str, error: str) -> str:
    """Which failures count as "the same way": the same task and the same error, its numbers aside
    (``train_step`` of step 5 and of step 6 failing with one OOM are one failure, twice)."""
    return f"{task.rsplit('.', 1)[-1]}: " + re.sub(r"\d+", "#", error)[:200]


def do_record_task_failure(run_id: int, task: str, error: str) -> Run | None:
    """A task of the run raised ``error``; after ``max_task_failures`` of the same signature, fail the run.

    Each failure is an event (warning) with the exception's text; the failing one ends the run with it as
    the reason (shown on the run page, in the API and the event log). A train step recorded since resets
    the counts (``finish_train_step``): the loop made progress, so earlier failures were transient.
    """
    with transaction.atomic():
        run = Run.objects.select_for_update().filter(pk=run_id).first()
        if run is None or run.status not in (*ACTIVE_STATUSES, RunStatus.PAUSED):
            return None
        spec = RunSpec.model_validate(run.spec)
        signature = failure_signature(task, error)
        failures: dict[str, int] = dict(run.state.get("failures", {}))
        failures[signature] = failures.get(signature, 0) + 1
        count, limit = failures[signature], spec.max_task_failures
        state = {**run.state, "failures": failures}
        Run.objects.filter(pk=run.pk).update(state=state)
        name = task.rsplit(".", 1)[-1]
        record_event(run, "task.failed", f"{name} failed ({count} of {limit}): {error}"[:2000],
                     level=RunEvent.Level.WARNING, data={"task": task, "error": error[:4000], "count": count,
                                                         "limit": limit})
        if count >= limit:
            run.state = state
            return do_fail_run(run, f"{name} failed {count} times the same way: {error}"[:1000])
    return run


# --- aliases -----------------------------------------------------------------------------------


def current_alias(base_model: BaseModel, alias: str) -> PolicyVersion | None:
    event = (
        AliasEvent.objects.filter(base_model=base_model, alias=alias)
        .select_related("version").order_by("-id").first()
    )
    return event.version if event else None


def do_promote_version(version: PolicyVersion, alias: str = Alias.PRODUCTION, *, actor: User = None,
                       reason: str = "", force: bool = False) -> AliasEvent:
    """Point ``alias`` of the version's base model at ``version``; the old target becomes ``previous``.

    A gated alias (``production`` and ``canary`` by default; see ``evaluation.GateConfig``) moves only when
    the version shows no per-domain regression against the alias's current version (or the base model)
    and enough average gain; otherwise ``InvalidTransition`` lists the reasons. ``force`` moves it anyway
    and records the overridden reasons.
    """
    from webapp.runs.evaluation import check_gate, gate_config

    if alias not in Alias.values or alias == Alias.PREVIOUS:
        raise ValidationFailed(f"cannot promote to alias {alias!r}",
                               details={"alias": [f"one of {', '.join(a for a in Alias.values if a != 'previous')}"]})
    base_model = version.run.base_model
    with transaction.atomic():
        BaseModel.objects.select_for_update().filter(pk=base_model.pk).first()  # serialise alias moves
        old = current_alias(base_model, alias)
        if old is not None and old.pk == version.pk:
            raise InvalidTransition(f"{alias} already points at {version}")
        refusals = check_gate(version, alias, old, gate_config(base_model.promotion_gate))
        if refusals and not force:
            raise InvalidTransition(
                f"the promotion gate refuses v{version.number} of run {version.run_id} as {alias}: "
                + "; ".join(refusals),
                details={"gate": refusals, "alias": alias, "version": version.number},
            )
        if refusals:
            reason = (reason + " " if reason else "") + "[forced past the gate: " + "; ".join(refusals) + "]"
        event = AliasEvent.objects.create(base_model=base_model, alias=alias, version=version, previous_version=old,
                                          action="promote", reason=reason, actor=_actor(actor))
        if old is not None and alias == Alias.PRODUCTION:
            AliasEvent.objects.create(base_model=base_model, alias=Alias.PREVIOUS, version=old,
                                      previous_version=current_alias(base_model, Alias.PREVIOUS),
                                      action="promote", reason=f"replaced in {alias} by {version}", actor=_actor(actor))
        record_event(version.run_id, "alias.promote", f"{alias} → v{version.number}", actor=actor,
                     level=RunEvent.Level.WARNING if refusals else RunEvent.Level.INFO,
                     data={"alias": alias, "version": version.number, "previous": old.number if old else None,
                           "forced_past_gate": refusals})
    return event


def do_rollback_alias(base_model: BaseModel, alias: str = Alias.PRODUCTION, *, actor: User = None,
                      reason: str = "") -> AliasEvent:
    """Point ``alias`` back at the version it pointed to before its last move."""
    with transaction.atomic():
        BaseModel.objects.select_for_update().filter(pk=base_model.pk).first()
        last = AliasEvent.objects.filter(base_model=base_model, alias=alias).order_by("-id").first()
        if last is None or last.previous_version is None:
            raise InvalidTransition(f"alias {alias!r} of {base_model.name} has no earlier version to roll back to")
        event = AliasEvent.objects.create(base_model=base_model, alias=alias, version=last.previous_version,
                                          previous_version=last.version, action="rollback", reason=reason,
                                          actor=_actor(actor))
        run_id = last.previous_version.run_id
        record_event(run_id, "alias.rollback",
                     f"{alias} rolled back to v{last.previous_version.number}", actor=actor,
                     data={"alias": alias, "version": last.previous_version.number})
    return event
