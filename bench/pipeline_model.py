"""What GPU-busy the scheduler allows when the machinery costs nothing: ``bench/pipeline.py``'s workload with
every hop, write and claim between the stages taken away, as a discrete-event simulation.

The decisions are the real ones: each event (a device request ends, a group's judging ends) takes a tick of
``workers.pipeline.scheduler.decide`` on the simulated run's groups, which drops the stale groups, claims the
train step and admits under the staleness and in-flight bounds as the loop does. What is simulated is the
rest: one device that serves a claimed train step, else a rollout of up to ``rollout_batch`` admitted groups
(oldest first), else nothing; a rollout of n groups takes n x ``rollout_s`` and samples under the version
the device holds as it starts; a group's judging takes the slowest of its G judge calls, each drawn from
``judge_delays`` (the bench's own measured delays); a train step takes ``train_s`` and trains the B oldest
ready groups. Between two device requests the device waits ``gap_s`` (the hand-off: what the real loop
spends between one device stretch and the next, reduced to one number).

Pure (no Django, no processes): ``bench/pipeline.py`` calls it with its measured figures and prints the
model's GPU-busy at no gap and at the measured one, and the largest gap that still reaches 0.95.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from workers.pipeline.scheduler import DomainShare, GroupFacts, PipelineLimits, RunSnapshot, decide


@dataclass
class _Group:
    id: int
    status: str = "admitted"
    version: int | None = None


def simulate(limits: PipelineLimits, *, group_size: int, rollout_s: float, train_s: float,
             judge_delays: Sequence[float], gap_s: float = 0.0, seconds: float = 120.0,
             warmup_s: float = 10.0, seed: int = 0) -> dict[str, float]:
    """GPU-busy, trajectories/s and the share of groups dropped too stale over ``seconds`` after
    ``warmup_s``, and the most versions a trained group lagged its step's; ``rollout_s`` is device seconds
    per group, ``train_s`` per step. (The run never completes: ``limits.max_steps`` is set aside.)"""
    if not judge_delays:
        raise ValueError("judge_delays is empty")
    limits = replace(limits, max_steps=1 << 62)
    rng = random.Random(seed)
    groups: dict[int, _Group] = {}
    judged: list[tuple[float, int]] = []  # (when its judging ends, group id)
    ids = iter(range(1, 1 << 62))
    now = free_at = 0.0
    version = step = trained = admitted = 0
    claim: int | None = None
    end = warmup_s + seconds
    busy = counted_trained = dropped = counted_dropped = 0.0
    lag = 0

    def tick() -> None:
        nonlocal claim, admitted, dropped, counted_dropped
        snap = RunSnapshot(
            status="running", version=version, step=step, trained=trained,
            groups=[GroupFacts(id=g.id, status=g.status, generated_version=g.version) for g in groups.values()],
            domains=[DomainShare(1, 1.0, admitted=admitted)], train_claim=claim)
        decision = decide(snap, limits)
        for gids in decision.drop.values():
            for gid in gids:
                del groups[gid]
                dropped += 1
                counted_dropped += now >= warmup_s
        if decision.claim_train is not None:
            claim = decision.claim_train
        for _ in range(decision.admit_total):
            gid = next(ids)
            groups[gid] = _Group(gid)
            admitted += 1

    tick()
    while now < end:
        if free_at <= now:  # the device takes its next request, if any
            if claim is not None:
                batch = sorted(g.id for g in groups.values() if g.status == "ready")[:limits.batch_groups]
                if len(batch) < limits.batch_groups:  # dropped too stale since the claim: as claim_batch, let go
                    claim = None
                    tick()
                    continue
                for gid in batch:
                    groups[gid].status = "training"
                work = train_s
                done_at = now + work
                busy += max(0.0, min(done_at, end) - max(now, warmup_s))
                now_end = done_at
                # the step's end: its groups trained, the next version
                for gid in batch:
                    lag = max(lag, version - (groups.pop(gid).version or 0))
                trained += len(batch)
                counted_trained += len(batch) * (done_at >= warmup_s and done_at < end)
                version += 1
                step += 1
                claim = None
                free_at, now = now_end + gap_s, now_end
                _flush(judged, groups, now)
                tick()
                continue
            waiting = sorted(g.id for g in groups.values() if g.status == "admitted")[:limits.rollout_batch]
            if waiting:
                work = rollout_s * len(waiting)
                done_at = now + work
                busy += max(0.0, min(done_at, end) - max(now, warmup_s))
                for gid in waiting:
                    g = groups[gid]
                    g.status, g.version = "verifying", version
                    heapq.heappush(judged, (done_at + max(rng.choice(judge_delays) for _ in range(group_size)), gid))
                free_at, now = done_at + gap_s, done_at
                _flush(judged, groups, now)
                tick()
                continue
        # nothing for the device now: on to the next event
        upcoming = [t for t in (judged[0][0] if judged else None, free_at if free_at > now else None) if t is not None]
        if not upcoming:
            break
        now = max(now, min(upcoming))
        _flush(judged, groups, now)
        tick()
    return {"gpu_busy": busy / seconds, "traj_s": counted_trained * group_size / seconds,
            "stale_share": counted_dropped / max(1.0, counted_dropped + counted_trained), "max_lag": float(lag)}


def _flush(judged: list[tuple[float, int]], groups: dict[int, _Group], now: float) -> None:
    """Groups whose judging has ended by ``now`` are ready (unless dropped meanwhile)."""
    while judged and judged[0][0] <= now:
        _, gid = heapq.heappop(judged)
        if gid in groups and groups[gid].status == "verifying":
            groups[gid].status = "ready"


def gap_for(target: float, limits: PipelineLimits, **kwargs: object) -> float:
    """The largest gap between device requests (seconds, to 0.5 ms) at which the model still reaches
    ``target`` GPU-busy: 0 when no gap of 0.5 ms or more does (not even none, perhaps)."""
    if simulate(limits, gap_s=0.0, **kwargs)["gpu_busy"] < target:  # type: ignore[arg-type]
        return 0.0
    low, high = 0.0, 0.2
    while high - low > 0.0005:
        mid = (low + high) / 2
        if simulate(limits, gap_s=mid, **kwargs)["gpu_busy"] >= target:  # type: ignore[arg-type]
            low = mid
        else:
            high = mid
    return low
