"""Session steps: the latency of one call of an episode's sandbox session against keeping state the naive way.

    python bench/sessions.py [--episodes 20] [--steps 10]

The same episodes on each side: ``--steps`` small cells (assign, update a variable, print it) per episode.

* ours: a ``SessionPool`` session per episode, with the tier's full isolation (namespaces, read-only root,
  cgroup limits, the harness); one cell per call, its state kept by the session's interpreter;
* replay in a sandbox: Temper's own one-shot warm sandbox, replaying every earlier cell of the episode
  before the new one (state kept by re-running it; the same isolation, a fork per call);
* naive: a fresh ``python -c`` per call replaying every earlier cell (no isolation at all).

Latency per call (p50, p95) and calls per second, one call at a time; episode open and close are timed
apart. The last line is ``result: key=value ...``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def cells(steps: int) -> list[str]:
    return ["total = 0"] + [f"total += {i}\nprint(total)" for i in range(1, steps)]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)

    from sandboxes import SandboxPool, SandboxSpec
    from sandboxes.session import SessionPool

    episode = cells(args.steps)
    expected = str(sum(range(1, args.steps)))
    rows: dict[str, dict[str, float]] = {}

    with SessionPool() as pool:
        tier = pool.tier
        pool.open().close()  # warm
        step_times, opens, closes, wrong = [], [], [], 0
        started = time.perf_counter()
        for _ in range(args.episodes):
            t = time.perf_counter()
            session = pool.open()
            opens.append(time.perf_counter() - t)
            out = ""
            for cell in episode:
                t = time.perf_counter()
                result = session.run(cell)
                step_times.append(time.perf_counter() - t)
                out = result.stdout
            wrong += out.strip() != expected
            t = time.perf_counter()
            session.close()
            closes.append(time.perf_counter() - t)
        total = time.perf_counter() - started
    rows["session (ours)"] = {"p50": quantile(step_times, 0.5), "p95": quantile(step_times, 0.95),
                              "per_s": len(step_times) / sum(step_times), "wrong": wrong,
                              "episode_s": total / args.episodes}

    with SandboxPool(size=1) as sandbox:
        step_times, wrong = [], 0
        started = time.perf_counter()
        for _ in range(args.episodes):
            out = ""
            for k in range(1, len(episode) + 1):
                t = time.perf_counter()
                result = sandbox.run(SandboxSpec(code="\n".join(episode[:k])))
                step_times.append(time.perf_counter() - t)
                out = result.stdout.decode().splitlines()[-1] if result.stdout else ""
            wrong += out.strip() != expected
        total = time.perf_counter() - started
    rows["replay in a sandbox"] = {"p50": quantile(step_times, 0.5), "p95": quantile(step_times, 0.95),
                                   "per_s": len(step_times) / sum(step_times), "wrong": wrong,
                                   "episode_s": total / args.episodes}

    step_times, wrong = [], 0
    started = time.perf_counter()
    for _ in range(max(1, args.episodes // 4)):  # slow: a quarter of the episodes
        out = ""
        for k in range(1, len(episode) + 1):
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", "\n".join(episode[:k])], capture_output=True, text=True)
            step_times.append(time.perf_counter() - t)
            out = proc.stdout.splitlines()[-1] if proc.stdout else ""
        wrong += out.strip() != expected
    total = time.perf_counter() - started
    rows["naive: python -c replay"] = {"p50": quantile(step_times, 0.5), "p95": quantile(step_times, 0.95),
                                       "per_s": len(step_times) / sum(step_times), "wrong": wrong,
                                       "episode_s": total / max(1, args.episodes // 4)}

    print(f"tier: {tier}; {args.episodes} episodes x {args.steps} calls; session open p50 "
          f"{statistics.median(opens) * 1e3:.2f} ms, close p50 {statistics.median(closes) * 1e3:.2f} ms\n")
    print(f"{'':26} {'p50 ms':>8} {'p95 ms':>8} {'calls/s':>9} {'episode s':>10} {'wrong':>6}")
    for name, r in rows.items():
        print(f"{name:26} {r['p50'] * 1e3:8.3f} {r['p95'] * 1e3:8.3f} {r['per_s']:9.0f} {r['episode_s']:10.3f} "
              f"{int(r['wrong']):6d}")
    ours, replay, naive = rows["session (ours)"], rows["replay in a sandbox"], rows["naive: python -c replay"]
    print(f"\ncalls/s: {ours['per_s'] / naive['per_s']:.0f}x the naive baseline, "
          f"{ours['per_s'] / replay['per_s']:.0f}x replaying in a one-shot sandbox")
    print(f"result: tier={tier} session_p50_ms={ours['p50'] * 1e3:.3f} session_p95_ms={ours['p95'] * 1e3:.3f} "
          f"session_calls_per_s={ours['per_s']:.0f} replay_p50_ms={replay['p50'] * 1e3:.3f} "
          f"naive_p50_ms={naive['p50'] * 1e3:.3f} ratio_vs_naive={ours['per_s'] / naive['per_s']:.1f} "
          f"ratio_vs_replay={ours['per_s'] / replay['per_s']:.1f} "
          f"open_p50_ms={statistics.median(opens) * 1e3:.2f} wrong={int(ours['wrong'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
