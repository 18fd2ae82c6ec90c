"""The pure scheduler: from a snapshot of one run's loop, every decision of a tick.

``decide(snapshot, limits)`` returns a ``Tick``: what to complete, pause, drop (with the reason), hand out
again (with the reason), which train step to claim or re-send, and what to admit. The Django half
(``webapp.runs.loop.tick``) builds the snapshot from rows under the run's lock and applies the tick; nothing
else decides. Pure: plain dataclasses in, plain dataclasses out; no Django, no Celery, no torch.

**Admission** bounds off-policyness the way AReaL does: new prompts start only while

    (max_staleness + v + 1) * B - (accepted + running) > 0

where ``v`` is the newest policy version, ``B`` the train batch in prompt groups, ``accepted`` the groups
already verified (ready, training or trained) and ``running`` those still being generated or verified. So no
sample can ever be more than ``max_staleness`` versions old when it is trained (one overtaken by later groups
while it is judged is dropped instead: see Staleness below). ``max_staleness = 0`` is the synchronous mode:
generate a batch, verify it, train on it, and only then generate the next. Retries come first: a prompt whose
group got an invalid verdict is admitted again ahead of new prompts. New prompts are spread across domains by
weight (largest deficit first, higher priority first). Backpressure: at most ``max_in_flight`` groups are in
flight. Generation is handed out in whole chunks of ``rollout_batch`` while the GPU worker has other work
queued, so it runs a few large batches rather than many small ones; a partial chunk goes out only when the
device would otherwise idle.

**Several runs on shared workers** (``Share``): each run has a share (``RunSpec.share``). A run whose
device time per unit of share is ahead of another active run's, while that run has generation queued and
waiting, admits nothing new this tick (its training goes on): the device goes to the run behind, so runs
progress in the ratio of their shares. It is work-conserving: a run is held back only for a run that has
work waiting for the device.

**Recovery** (only on the periodic tick, ``snapshot.recovering``): work in flight is handed out again when
its holder is known gone, when the broker lost its queued messages, or after ``stall_s`` without progress;
a group is dropped after ``max_attempts``. A train claim is re-sent for the same reasons.

**Staleness**: groups generated more than ``max_staleness`` versions before the newest are dropped before
anything is counted (a group too stale to train must not count towards a batch), ready ones and those still
being judged alike, and before recovery (which neither hands them out again nor counts them); a pausing run
drops them too rather than wait for them. The admission bound counts groups, not versions: it keeps the
pipeline's groups within ``max_staleness`` versions of each other only while they are trained in the order
they were generated. A group whose judging is slow (a heavy-tailed judge, a sandbox's tail) is overtaken by
later ones while the versions move on, and is dropped; ``bench/pipeline.py`` counts these (``stale_share``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

IN_FLIGHT = ("admitted", "generating", "verifying")
"""Groups admitted but not yet verified: the stages whose work a lost message can strand."""
STALE = "staler than"
"""How the drop reason of a group too stale to train starts (the staleness alert and bench/pipeline.py count
them by it)."""
WAITING = ("admitted", "generating")
"""Groups whose generation is queued or under way (a rollout task has them or is still to come)."""


@dataclass(frozen=True)
class DomainShare:
    domain_id: int
    weight: float
    priority: int = 0
    admitted: int = 0
    """Groups of this domain admitted so far (dropped ones excluded)."""
    exhausted: bool = False
    """No train task left to admit (an empty domain)."""
    retries: int = 0
    """Prompts of this domain waiting to be admitted again after an invalid verdict."""


@dataclass(frozen=True)
class PipelineLimits:
    batch_groups: int
    """B: complete groups per train step."""
    max_staleness: int
    rollout_batch: int
    """Most groups handed to one generation task."""
    max_in_flight: int
    """Backpressure: most groups admitted but not yet verified."""
    max_steps: int
    admit_ahead: bool = False
    """Count a claimed train step as done when computing the staleness room (async mode): the next prompts
    are admitted while it trains, and reach the device after it, under the version it produces."""
    stall_s: float = 90.0
    """Hand out again work that made no progress for this long (a message lost some other way)."""
    max_attempts: int = 3
    """Drop a group, with the reason, after this many hand-outs."""


@dataclass(frozen=True)
class GroupFacts:
    """A group not yet trained or dropped, as the recovery and staleness decisions need it."""

    id: int
    status: str
    """admitted | generating | verifying | ready | training"""
    attempt: int = 0
    age_s: float = 0.0
    """Seconds since its last progress."""
    holder_gone: str | None = None
    """Why the worker holding it is known gone (stopped, restarted, silent); None while it may still work."""
    generated_version: int | None = None


@dataclass(frozen=True)
class Share:
    """This run against the other active runs on the same workers."""

    share: float = 1.0
    device_s: float = 0.0
    """Device seconds this run has used lately (decayed over about a minute)."""
    others: Sequence[tuple[float, float, bool]] = ()
    """Each other running run: (share, its recent device seconds, has generation waiting)."""


@dataclass(frozen=True)
class RunSnapshot:
    status: str
    """The run's status: queued, running, pausing, paused, completed, failed, cancelled."""
    version: int
    step: int
    trained: int
    """Groups trained so far."""
    groups: Sequence[GroupFacts]
    domains: Sequence[DomainShare]
    train_claim: int | None = None
    train_claim_age_s: float = 0.0
    train_holder_gone: str | None = None
    train_holder_alive: bool = False
    """The train claim's holder is recorded and its heartbeat says it still works on it."""
    recovering: bool = False
    """The periodic recovery tick: also look for stranded work."""
    broker_reset: bool = False
    """The broker lost its data since the last tick: every queued message is gone."""
    share: Share = field(default_factory=Share)


@dataclass(frozen=True)
class PipelineState:
    """The counts admission works on (derived from a snapshot)."""

    version: int
    step: int
    accepted: int
    """Groups verified so far: ready + training + trained."""
    running: int
    """Groups admitted but not yet verified: admitted + generating + verifying."""
    ready: int
    training: bool
    """A train step is claimed and not finished."""
    domains: Sequence[DomainShare]
    waiting: int = 0
    """Groups admitted or being generated: a rollout task has them or is still to come (part of ``running``)."""


@dataclass
class Plan:
    """The admission part of a tick."""

    admit: dict[int, int] = field(default_factory=dict)
    """domain id -> new prompts to admit now."""
    retry: dict[int, int] = field(default_factory=dict)
    """domain id -> prompts to admit again after an invalid verdict (ahead of new ones)."""
    train: bool = False
    """Claim the next train step on B ready groups."""
    complete: bool = False

    @property
    def admit_total(self) -> int:
        return sum(self.admit.values()) + sum(self.retry.values())


@dataclass
class Tick:
    """Every decision of one tick, for the Django half to apply in order."""

    drop: dict[str, list[int]] = field(default_factory=dict)
    """reason -> groups to drop (too stale, stranded too often, unfinished in an ended run)."""
    regenerate: list[int] = field(default_factory=list)
    """Groups whose generation is handed out again (back to admitted, attempt + 1)."""
    reverify: list[int] = field(default_factory=list)
    """Groups whose judging is handed out again (attempt + 1)."""
    why: dict[str, int] = field(default_factory=dict)
    """Why work was handed out again: reason -> groups."""
    resend_train: str | None = None
    """Re-send the claimed train step, for this reason."""
    claim_train: int | None = None
    """Claim this train step."""
    admit: dict[int, int] = field(default_factory=dict)
    retry: dict[int, int] = field(default_factory=dict)
    complete: str | None = None
    """Complete the run, for this reason."""
    mark_paused: bool = False
    revoke: bool = False
    """The run has ended: revoke its queued messages."""
    deferred: bool = False
    """Admission held back for another run on the same workers (fair share)."""

    @property
    def admit_total(self) -> int:
        return sum(self.admit.values()) + sum(self.retry.values())


# ---------------------------------------------------------------- admission arithmetic


def admission_capacity(state: PipelineState, limits: PipelineLimits) -> int:
    """How many more groups may start under the staleness bound and the in-flight bound."""
    version = state.version + (1 if limits.admit_ahead and state.training else 0)
    staleness_room = (limits.max_staleness + version + 1) * limits.batch_groups - (state.accepted + state.running)
    flight_room = limits.max_in_flight - state.running
    steps_left = limits.max_steps - state.step
    # never admit more than the remaining steps can train
    total_room = steps_left * limits.batch_groups - (state.accepted - state.step * limits.batch_groups) - state.running
    return max(0, min(staleness_room, flight_room, limits.rollout_batch, total_room))


def open_window(limits: PipelineLimits) -> int:
    """The most groups the staleness bound lets be neither trained nor dropped at once: those of every version
    from the newest back ``max_staleness``, one more batch while a step trains with ``admit_ahead`` (async
    mode: (S + 2) x B), and B in sync mode. ``bench/pipeline.py`` bounds GPU-busy by it (Little's law)."""
    return limits.batch_groups * (limits.max_staleness + 1 + (1 if limits.admit_ahead else 0))


def split_by_weight(domains: Sequence[DomainShare], n: int) -> dict[int, int]:
    """Give ``n`` admissions to domains: higher priority first, then the largest weighted deficit."""
    live = [d for d in domains if not d.exhausted and d.weight > 0]
    if n <= 0 or not live:
        return {}
    top = max(d.priority for d in live)
    pool = [d for d in live if d.priority == top]
    total_weight = sum(d.weight for d in pool)
    counts = {d.domain_id: d.admitted for d in pool}
    grand = sum(counts.values())
    out: dict[int, int] = {}
    for _ in range(n):
        grand += 1
        # deficit: the share a domain should have after this admission minus what it has
        best = max(pool, key=lambda d: (grand * d.weight / total_weight - counts[d.domain_id], -d.domain_id))
        counts[best.domain_id] += 1
        out[best.domain_id] = out.get(best.domain_id, 0) + 1
    return out


def take_retries(domains: Sequence[DomainShare], n: int) -> dict[int, int]:
    """Up to ``n`` retries, higher priority domains first, then by domain id (the order is stable)."""
    out: dict[int, int] = {}
    for d in sorted(domains, key=lambda d: (-d.priority, d.domain_id)):
        if n <= 0:
            break
        take = min(n, d.retries)
        if take > 0:
            out[d.domain_id] = take
            n -= take
    return out


def plan(state: PipelineState, limits: PipelineLimits) -> Plan:
    """The admission and train-claim part of a tick, from the counts alone."""
    result = Plan()
    if state.step >= limits.max_steps:
        result.complete = not state.training
        return result
    result.train = not state.training and state.ready >= limits.batch_groups
    # the step claimed now trains from this tick on: with admit_ahead, its successors are admitted in the same
    # tick, so their rollout is prepared while it trains, not after it has recorded its version
    capacity = admission_capacity(replace(state, training=True) if result.train else state, limits)
    if capacity < min(limits.rollout_batch, limits.batch_groups) and (
            state.waiting > 0 or state.training or result.train):
        # the GPU worker has work queued (a rollout task still to come, or a train step): wait for room
        # for a whole chunk rather than queue a small one, each task having a fixed cost
        capacity = 0
    result.retry = take_retries(state.domains, capacity)
    # a retried prompt counts towards its domain's share, like any other admission
    shares = [replace(d, admitted=d.admitted + result.retry.get(d.domain_id, 0)) for d in state.domains]
    result.admit = split_by_weight(shares, capacity - sum(result.retry.values()))
    return result


def behind_another(share: Share) -> bool:
    """True when another run with generation waiting has used less device time per unit of share."""
    mine = share.device_s / max(share.share, 1e-9)
    return any(waiting and seconds / max(other, 1e-9) < mine for other, seconds, waiting in share.others)


# ---------------------------------------------------------------- the whole tick


def _recover(snap: RunSnapshot, limits: PipelineLimits, tick: Tick, skip: set[int]) -> set[int]:
    """Hand stranded work out again (not ``skip``: dropped as too stale this tick); returns the groups dropped
    for having been stranded too often."""
    dropped: set[int] = set()
    for g in snap.groups:
        if g.status not in IN_FLIGHT or g.id in skip:
            continue
        if snap.broker_reset:
            why = "the broker lost its queued messages"
        elif g.holder_gone is not None:
            why = g.holder_gone
        elif g.age_s >= limits.stall_s:
            why = f"no progress for {limits.stall_s:.0f} s"
        else:
            continue
        tick.why[why] = tick.why.get(why, 0) + 1
        if g.attempt >= limits.max_attempts:
            tick.drop.setdefault(f"stalled in {g.status} after {g.attempt} attempts ({why})", []).append(g.id)
            dropped.add(g.id)
        elif g.status in WAITING:
            tick.regenerate.append(g.id)
        else:
            tick.reverify.append(g.id)
    if snap.train_claim is not None:
        # A claim a live worker holds is being trained there (a train task took it, or a generate task trained
        # it ahead): it is in no queue the broker lost, and a copy sent now would train the step a second
        # time beside it (the version's files overwritten by the copy's). Its task finishes it, or its failure
        # re-sends it; the stall rule below still applies.
        if snap.broker_reset and not snap.train_holder_alive:
            tick.resend_train = "the broker lost its queued messages"
        elif snap.train_holder_gone is not None:
            tick.resend_train = snap.train_holder_gone
        elif snap.train_claim_age_s >= limits.stall_s:
            tick.resend_train = f"no progress for {limits.stall_s:.0f} s"
    return dropped


def decide(snap: RunSnapshot, limits: PipelineLimits) -> Tick:
    """Every decision of one tick of one run."""
    tick = Tick()
    if snap.status in ("cancelled", "failed", "completed"):
        tick.revoke = True
        unfinished = [g.id for g in snap.groups]
        if unfinished:
            tick.drop[f"run {snap.status} before it was trained"] = unfinished
        return tick
    # A group still being judged is dropped as soon as it is too stale, not when its verdicts are in: versions
    # only grow, so it could never be trained, and meanwhile it held a place under the staleness bound (a
    # judge's slow tail held such groups ~1.7 s in bench/pipeline.py: ~13 of its 80 places). Decided before
    # recovery, which neither hands such a group out again nor counts it among the stranded.
    # (A pausing run drops them too: its pause would otherwise wait for judging that can come to nothing.)
    stale = [g.id for g in snap.groups if g.status in ("verifying", "ready") and g.generated_version is not None
             and g.generated_version < snap.version - limits.max_staleness
             ] if snap.status in ("running", "pausing") else []
    dropped = _recover(snap, limits, tick, set(stale)) if snap.recovering else set()
    if stale:
        tick.drop[f"{STALE} {limits.max_staleness} version(s) at step {snap.step + 1}"] = stale
    gone = dropped | set(stale)
    if snap.status == "pausing":
        in_flight = [g for g in snap.groups if g.id not in gone and g.status in (*IN_FLIGHT, "training")]
        tick.mark_paused = not in_flight and snap.train_claim is None
        return tick
    if snap.status != "running":
        return tick
    live = [g for g in snap.groups if g.id not in gone]
    by_status: dict[str, int] = {}
    for g in live:
        by_status[g.status] = by_status.get(g.status, 0) + 1
    state = PipelineState(
        version=snap.version, step=snap.step,
        accepted=snap.trained + by_status.get("ready", 0) + by_status.get("training", 0),
        running=sum(by_status.get(s, 0) for s in IN_FLIGHT), ready=by_status.get("ready", 0),
        training=snap.train_claim is not None or by_status.get("training", 0) > 0, domains=snap.domains,
        waiting=sum(by_status.get(s, 0) for s in WAITING))
    result = plan(state, limits)
    if result.complete:  # (never while a step trains)
        tick.complete = f"reached max_steps={limits.max_steps}"
        tick.regenerate, tick.reverify, tick.resend_train = [], [], None  # nothing is handed out any more
        if live:
            tick.drop.setdefault("run completed before it was trained", []).extend(g.id for g in live)
        return tick
    if result.train:
        tick.claim_train = snap.step + 1
    if result.admit_total and behind_another(snap.share):
        # another run with generation waiting is behind its share: the device goes to it first (this run's
        # queued work and its training go on; it only admits nothing new until it is no longer ahead)
        tick.deferred = True
        return tick
    tick.admit, tick.retry = result.admit, result.retry
    return tick
