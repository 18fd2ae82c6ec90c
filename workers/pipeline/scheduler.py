"""The pure scheduler: from a snapshot of a run's pipeline, decide what to start next.

Admission bounds off-policyness the way AReaL does: new prompts start only while

    (max_staleness + v + 1) * B - (accepted + running) > 0

where ``v`` is the newest policy version, ``B`` the train batch in prompt groups, ``accepted`` the groups
already verified (ready, training or trained) and ``running`` those still being generated or verified.
So no sample can ever be more than ``max_staleness`` versions old when it is trained, and nothing is
generated only to be thrown away. ``max_staleness = 0`` is the synchronous mode: generate a batch,
verify it, train on it, and only then generate the next.

Retries come first: a prompt whose group got an invalid verdict (the verifier could not judge, which is
never scored 0) is admitted again ahead of new prompts, at most ``invalid_retries`` times. New prompts are
spread across domains by weight (largest deficit first, higher priority first), so hundreds of domains
share the budget in proportion. Backpressure: at most ``max_in_flight`` groups are in flight, so a slow
verifier or trainer holds generation back instead of growing queues without bound. Generation is handed
out in whole chunks of ``rollout_batch`` while the GPU worker has other work queued (prompts waiting for
a rollout task, or a train step), so it runs a few large batches rather than many small ones (each task
has a fixed cost); a partial chunk goes out only when the device would otherwise idle.

Pure: plain dataclasses in, plain dataclasses out; no Django, no Celery, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace


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
class PipelineState:
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


@dataclass(frozen=True)
class Limits:
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


@dataclass
class Plan:
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


def admission_capacity(state: PipelineState, limits: Limits) -> int:
    """How many more groups may start under the staleness bound and the in-flight bound."""
    version = state.version + (1 if limits.admit_ahead and state.training else 0)
    staleness_room = (limits.max_staleness + version + 1) * limits.batch_groups - (state.accepted + state.running)
    flight_room = limits.max_in_flight - state.running
    steps_left = limits.max_steps - state.step
    # never admit more than the remaining steps can train
    total_room = steps_left * limits.batch_groups - (state.accepted - state.step * limits.batch_groups) - state.running
    return max(0, min(staleness_room, flight_room, limits.rollout_batch, total_room))


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


def plan(state: PipelineState, limits: Limits) -> Plan:
    """What to start next. Idempotent given the same state: the caller applies it under the run's lock."""
    result = Plan()
    if state.step >= limits.max_steps:
        result.complete = not state.training
        return result
    result.train = not state.training and state.ready >= limits.batch_groups
    capacity = admission_capacity(state, limits)
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
