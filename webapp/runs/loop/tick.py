"""A tick of one run: its rows turned into the scheduler's snapshot, the scheduler's decisions applied.

``advance(run_id)`` locks the run row, moves a queued run to running, builds a ``RunSnapshot`` (the groups
not yet trained or dropped, the train claim, the domains' shares, and on the recovery tick the holders'
liveness and the broker's state), asks ``scheduler.decide`` for the whole tick and applies it: drops with
their reasons, work handed out again, the train claim, admission, completion, pause, revocation. Messages
are sent after commit. ``recover_all()`` is the periodic tick over every active run. Every decision is the
scheduler's; this module only reads and writes rows.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from datetime import datetime
from functools import partial

from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from webapp.common.errors import InvalidTransition
from webapp.runs import services
from webapp.runs.loop import accounting, admission, live
from webapp.runs.loop.recovery import WorkerLiveness, broker_was_reset
from webapp.runs.models import PromptGroup, Run, RunStatus
from workers import messages
from workers.pipeline.scheduler import (
    IN_FLIGHT,
    DomainShare,
    GroupFacts,
    PipelineLimits,
    RunSnapshot,
    Share,
    Tick,
    decide,
)
from workers.pipeline.spec import RunSpec

log = logging.getLogger(__name__)
G = PromptGroup.Status
OPEN = (G.ADMITTED, G.GENERATING, G.VERIFYING, G.READY, G.TRAINING)
"""Groups neither trained nor dropped: what a snapshot lists."""
ACTIVE = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.PAUSING)


def limits_for(spec: RunSpec) -> PipelineLimits:
    from django.conf import settings

    p = spec.pipeline
    staleness = 0 if p.mode == "sync" else p.max_staleness
    # In flight (admitted, not yet verified): two batches, or every batch the staleness bound lets ahead
    in_flight = max(max(p.rollout_batch_prompts, p.batch_prompts) * 2, (staleness + 1) * p.batch_prompts)
    return PipelineLimits(batch_groups=p.batch_prompts, max_staleness=staleness, rollout_batch=p.rollout_batch_prompts,
                          max_in_flight=in_flight, max_steps=spec.max_steps, admit_ahead=p.mode == "async",
                          stall_s=float(settings.TEMPER_STALL_SECONDS))


def _share(run: Run, spec: RunSpec) -> Share:
    """This run against the other running runs (the device is shared by all of them)."""
    others = list(Run.objects.filter(status=RunStatus.RUNNING).exclude(pk=run.pk).values_list("pk", "spec"))
    if not others:
        return Share(share=spec.share)
    seconds = live.device_seconds([run.pk, *(pk for pk, _ in others)])
    waiting = set(PromptGroup.objects.filter(run_id__in=[pk for pk, _ in others], status__in=(G.ADMITTED, G.GENERATING))
                  .order_by().values_list("run_id", flat=True).distinct())
    return Share(share=spec.share, device_s=seconds[run.pk],
                 others=[(float(s.get("share", 1.0)), seconds[pk], pk in waiting) for pk, s in others])


def snapshot(run: Run, spec: RunSpec, *, recovering: bool = False, broker_reset: bool = False,
             liveness: WorkerLiveness | None = None) -> RunSnapshot:
    now = timezone.now()
    # unordered: ordered by id, SQLite read the run's every group through its (run, -id) index
    rows = list(PromptGroup.objects.filter(run=run, status__in=OPEN).order_by().values_list(
        "id", "status", "attempt", "updated_at", "holder", "generated_version", "domain_id"))
    groups = [GroupFacts(id=gid, status=status, attempt=attempt, age_s=(now - updated).total_seconds(),
                         holder_gone=liveness.gone(holder, updated) if liveness and status in IN_FLIGHT else None,
                         generated_version=generated)
              for gid, status, attempt, updated, holder, generated, _ in rows]
    # A run's groups are these open ones, the trained ones (counted by each step's record, Run.trained_groups)
    # and the dropped ones: a tick reads the open rows only, whatever the run's length (counting the trained
    # and the admitted from the group table took 65 ms a tick at 200,000 groups on SQLite: bench/longrun.py)
    trained = sum(run.trained_groups.values())
    per_domain: Counter[int | None] = Counter(domain_id for *_, domain_id in rows)
    for domain_id, n in run.trained_groups.items():
        per_domain[int(domain_id) if domain_id else None] += n
    retries = dict(PromptGroup.objects.filter(run=run, retry_pending=True).values_list("domain_id")
                   .annotate(n=Count("id")).order_by())
    exhausted = set(run.state.get("exhausted", [])) | {int(k) for k in run.state.get("set_aside", {})}
    domains = [DomainShare(rd.domain_id, rd.weight, rd.priority, per_domain.get(rd.domain_id, 0),
                           rd.domain_id in exhausted, retries.get(rd.domain_id, 0)) for rd in run.run_domains.all()]
    claim = run.state.get("train_claim")
    claim_age = (now - run.updated_at).total_seconds() if claim else 0.0
    holder, held_at = run.state.get("train_holder"), run.state.get("train_held_at")
    holder_gone = (liveness.gone(holder, datetime.fromtimestamp(float(held_at), tz=now.tzinfo))
                   if liveness and claim and holder and held_at else None)
    return RunSnapshot(status=run.status, version=run.latest_version, step=run.step, trained=trained, groups=groups,
                       domains=domains, train_claim=int(claim) if claim else None, train_claim_age_s=claim_age,
                       train_holder_gone=holder_gone,
                       train_holder_alive=bool(liveness and claim and holder and held_at and holder_gone is None),
                       recovering=recovering, broker_reset=broker_reset,
                       share=_share(run, spec) if run.status == RunStatus.RUNNING else Share(share=spec.share))


def _apply(run: Run, spec: RunSpec, tick: Tick, train_here: str = "") -> int | None:
    """Write the tick's decisions (under the run's lock) and queue its messages for after commit. A train
    step claimed with ``train_here`` (a holder) is held by that worker's calling task, which trains it: no
    message is sent for it. Returns the train step claimed, if any."""
    now = timezone.now()
    if tick.revoke:  # the queued ids are read before the groups are dropped
        transaction.on_commit(partial(messages.revoke, queued_ids(run)))
    for reason, ids in tick.drop.items():
        PromptGroup.objects.filter(pk__in=ids).exclude(status__in=(G.TRAINED, G.DROPPED)).update(
            status=G.DROPPED, drop_reason=reason[:200], retry_pending=False, updated_at=now)
    attempts: dict[int, int] = {}
    for gid, attempt in PromptGroup.objects.filter(pk__in=[*tick.regenerate, *tick.reverify]).values_list("id", "attempt"):
        attempts[gid] = attempt + 1
    for gid in tick.regenerate:
        PromptGroup.objects.filter(pk=gid).update(status=G.ADMITTED, attempt=attempts[gid], holder="", updated_at=now)
    for gid in tick.reverify:
        PromptGroup.objects.filter(pk=gid).update(attempt=attempts[gid], holder="", updated_at=now)
    if tick.why:
        log.warning("run %s: handing work out again (%s)", run.pk, tick.why)
    size = spec.pipeline.rollout_batch_prompts
    if tick.regenerate:
        transaction.on_commit(partial(messages.generate_chunks, run.pk, list(tick.regenerate), size, attempts))
    if tick.reverify:
        transaction.on_commit(partial(messages.verify_groups, run.pk, list(tick.reverify),
                                      [attempts[g] for g in tick.reverify]))
    if tick.resend_train and run.state.get("train_claim"):
        log.warning("run %s: re-sending train step %s (%s)", run.pk, run.state["train_claim"], tick.resend_train)
        transaction.on_commit(partial(messages.train_step, run.pk, int(run.state["train_claim"])))
    if tick.complete:
        services.do_complete_run(run, tick.complete)
        return None
    if tick.mark_paused:
        services.do_mark_paused(run)
        return None
    state_changed = False
    if tick.claim_train is not None:
        run.state["train_claim"] = tick.claim_train
        run.state["train_claim_at"] = time.time()
        state_changed = True
        if train_here:  # recovery re-sends it if this holder is gone, as for a claim a train task took
            run.state.update(train_holder=train_here, train_held_at=time.time())
        else:
            transaction.on_commit(partial(messages.train_step, run.pk, tick.claim_train))
    if tick.deferred != bool(run.state.get("deferred_since")):
        if tick.deferred:
            run.state["deferred_since"] = time.time()
        else:
            run.state.pop("deferred_since", None)
        state_changed = True
    if state_changed:
        # updated_at marks when the claim was made: the recovery tick re-sends it only once stale
        Run.objects.filter(pk=run.pk).update(state=run.state, **({"updated_at": now} if tick.claim_train else {}))
    if tick.admit_total:
        ids = admission.admit(run, tick.admit, tick.retry)
        transaction.on_commit(partial(messages.generate_chunks, run.pk, ids, size))
    return tick.claim_train


def advance(run_id: int, *, recovering: bool = False, broker_reset: bool = False,
            liveness: WorkerLiveness | None = None) -> str:
    """Take the next step of a run's loop. Idempotent: re-reads the run under its row lock and acts on it."""
    return _advance(run_id, recovering=recovering, broker_reset=broker_reset, liveness=liveness)[0]


def advance_holding_train(run_id: int, holder: str) -> int | None:
    """``advance``, where a train step the tick claims is held by ``holder`` (this worker) for the calling
    task to train, not sent to the train queue: the step's number, or None when none was claimed. (A step
    trained ahead of its claim, ``training.conclude_ahead``.)"""
    return _advance(run_id, train_here=holder)[1]


def _advance(run_id: int, *, recovering: bool = False, broker_reset: bool = False,
             liveness: WorkerLiveness | None = None, train_here: str = "") -> tuple[str, int | None]:
    claimed = None
    try:
        with transaction.atomic():
            run = Run.objects.select_for_update().filter(pk=run_id).first()
            if run is None:
                return "gone", None
            if run.status == RunStatus.QUEUED:
                first_start = run.started_at is None
                run = services.do_mark_running(run)
                # from here on the ticks read the kept count: a start or a resume checks it against the groups
                accounting.recount_trained(run)
                if first_start:  # the base model's held-out level
                    live.forget_usage(run_id)
                    transaction.on_commit(partial(messages.evaluate, run_id, 0))
            if run.status == RunStatus.PAUSED:
                return str(run.status), None
            spec = RunSpec.model_validate(run.spec)
            tick = decide(snapshot(run, spec, recovering=recovering, broker_reset=broker_reset, liveness=liveness),
                          limits_for(spec))
            claimed = _apply(run, spec, tick, train_here)
    except InvalidTransition as exc:  # another delivery or a person moved it first
        log.info("advance(%s): %s", run_id, exc)
        claimed = None
    return str(Run.objects.filter(pk=run_id).values_list("status", flat=True).first()), claimed


def recover_all() -> list[int]:
    """The periodic tick: every active run looks for stranded work (one liveness read and one broker check
    for all), then is advanced. Returns the runs it ticked."""
    everything = broker_was_reset()
    liveness = WorkerLiveness.now()
    runs = list(Run.objects.filter(status__in=ACTIVE).values_list("pk", flat=True))
    for run_id in runs:
        advance(run_id, recovering=True, broker_reset=everything, liveness=liveness)
    return runs


def queued_ids(run: Run) -> list[str]:
    """Ids of every task that may still be queued for the run's unfinished work (for revocation)."""
    ids = []
    for gid, status, attempt in PromptGroup.objects.filter(run=run, status__in=IN_FLIGHT).order_by().values_list(
            "id", "status", "attempt"):
        ids.append(messages.verify_id(run.pk, gid, attempt) if status == G.VERIFYING
                   else messages.generate_id(run.pk, gid, attempt))
    if claim := run.state.get("train_claim"):
        ids.append(messages.train_id(run.pk, int(claim)))
    return ids


def wake_deferred(except_run: int | None = None) -> None:
    """Advance the runs held back for a fair share (after another run used the device)."""
    deferred = [pk for pk, state in Run.objects.filter(status=RunStatus.RUNNING).values_list("pk", "state")
                if state.get("deferred_since") and pk != except_run]
    for pk in deferred:
        messages.advance_run(pk)
