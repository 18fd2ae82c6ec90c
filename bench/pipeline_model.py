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

No processes and no database: ``bench/pipeline.py`` calls it with its measured figures and prints the
model's GPU-busy at no gap and at the measured one, and the largest gap that still reaches 0.95. Run
alone, it prints GPU-busy by max_staleness and gap on given device figures (SQLite's measured ones by
default: docs/ARCHITECTURE.md's table):

    .venv/bin/python bench/pipeline_model.py [--rollout-ms 3.53 --train-ms 182 --staleness 3,4,5,8]
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from workers.pipeline.scheduler import DomainShare, GroupFacts, PipelineLimits, RunSnapshot, decide  # noqa: E402


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


def judge_delays(median_ms: float = 100.0, sigma: float = 1.0, cap_s: float = 5.0, n: int = 30_000,
                 seed: int = 1) -> list[float]:
    """Delays of ``bench/pipeline.py``'s judge (lognormal, capped), drawn afresh."""
    rng = random.Random(seed)
    return [min(cap_s, math.exp(math.log(median_ms / 1000) + sigma * rng.gauss(0.0, 1.0))) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollout-ms", type=float, default=3.53,
                        help="device ms a rollout's group (bench/pipeline.py's row; SQLite's measured default)")
    parser.add_argument("--train-ms", type=float, default=182.0, help="device ms a train step")
    parser.add_argument("--staleness", default="3,4,5,8", help="max_staleness values, one row each")
    parser.add_argument("--gaps-ms", default="0,10,20,43", help="gaps between device requests, one column each")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--rollout-batch", type=int, default=16)
    parser.add_argument("--judge-median-ms", type=float, default=100.0)
    parser.add_argument("--judge-sigma", type=float, default=1.0)
    parser.add_argument("--judge-cap-s", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=120.0, help="simulated seconds a cell")
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()  # limits_for reads a setting; nothing touches a database
    from webapp.runs.loop.tick import limits_for
    from workers.pipeline.spec import RunSpec

    gaps = [float(g) for g in args.gaps_ms.split(",")]
    work = dict(group_size=args.group, rollout_s=args.rollout_ms / 1000, train_s=args.train_ms / 1000,
                judge_delays=judge_delays(args.judge_median_ms, args.judge_sigma, args.judge_cap_s),
                seconds=args.seconds)
    print(f"model: B={args.batch} G={args.group}, rollout chunks of {args.rollout_batch}, {args.rollout_ms} ms of device "
          f"a rollout's group, {args.train_ms} ms a train step; judge median {args.judge_median_ms:.0f} ms, sigma "
          f"{args.judge_sigma}\n")
    print(f"{'max_staleness':>13}" + "".join(f"{f'busy @{g:g} ms':>14}" for g in gaps)
          + f"{'stale @0':>10}{'gap for 0.95':>14}")
    out: dict[str, float] = {}
    for staleness in (int(s) for s in args.staleness.split(",")):
        limits = limits_for(RunSpec.model_validate({"pipeline": {
            "mode": "async", "max_staleness": staleness, "batch_prompts": args.batch,
            "rollout_batch_prompts": args.rollout_batch, "group_size": args.group}}))
        cells = [simulate(limits, gap_s=g / 1000, **work) for g in gaps]
        free = cells[gaps.index(0.0)] if 0.0 in gaps else simulate(limits, **work)  # the machinery free: no gap
        gap = 1000 * gap_for(0.95, limits, **work)
        print(f"{staleness:>13}" + "".join(f"{c['gpu_busy']:>14.3f}" for c in cells)
              + f"{free['stale_share']:>10.3f}"
              + (f"{gap:>11.1f} ms" if gap else f"{'< 0.5 ms' if free['gpu_busy'] >= 0.95 else 'none':>14}"))
        out[f"busy_free_s{staleness}"] = free["gpu_busy"]
        out[f"gap_095_ms_s{staleness}"] = gap
    print("\nresult: " + " ".join(f"{k}={v:.3f}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
