"""What the run page draws: chart definitions (metric names per chart) and the runs list's sparklines.

The definitions travel to the browser as JSON; ``static/temper/charts.js`` fetches each chart's series
from ``/api/v1/metrics/`` (downsampled to ~1,000 points, min and max per bucket) and extends them live.
A metric the definitions do not name still appears, in the "Other metrics" chart. A chart marked
``episodes`` draws the episodes of multi-turn domains; the run page leaves it out of a single-turn run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

CHARTS: list[dict[str, Any]] = [
    {"id": "heldout", "title": "Held-out reward", "names": ["heldout_reward"], "y": "reward", "range": [0, 1]},
    {"id": "reward", "title": "Train reward per domain", "names": ["reward", "reward_mean"], "y": "reward"},
    {"id": "pass_rate", "title": "Pass rate per domain", "names": ["pass_rate"], "y": "pass rate", "range": [0, 1]},
    {"id": "throughput", "title": "Throughput", "names": ["trajectories_per_s", "tokens_per_s"], "y": "per second",
     "log": True},
    {"id": "latency", "title": "Stage latencies", "names": ["generate_seconds", "train_seconds", "train_task_seconds"],
     "prefixes": ["verify_group_s"], "y": "seconds"},
    {"id": "waits", "title": "Queue waits (time a piece of work waited for its worker)",
     "names": ["generate_queue_wait_s", "train_queue_wait_s"], "prefixes": ["verify_queue_wait_s"], "y": "seconds"},
    {"id": "verify_latency", "title": "Verify latency per judgment (p50/p95 per domain)",
     "names": ["verify_latency_ms_p50", "verify_latency_ms_p95"], "y": "ms"},
    {"id": "queues", "title": "Queue depths: prompt groups per stage, in flight", "prefixes": ["groups_"],
     "names": ["in_flight"], "y": "groups"},
    {"id": "gpu_busy", "title": "GPU-busy fraction", "names": ["gpu_busy"], "y": "fraction", "range": [0, 1.05]},
    {"id": "staleness", "title": "Staleness: mean, max, per sampled token of episodes, and samples per lag (versions behind)",
     "names": ["staleness_mean", "staleness_max", "staleness_token_mean"], "prefixes": ["staleness_lag_"],
     "y": "versions / samples"},
    {"id": "trainer", "title": "Trainer: loss, KL to the behaviour policy and to the base, entropy, clip fraction, "
                               "gradient norm",
     "names": ["loss", "kl", "kl_ref", "entropy", "clip_fraction", "grad_norm"], "y": "value"},
    {"id": "quality", "title": "Invalid, zero-variance and truncated shares",
     "names": ["invalid_rate", "zero_variance_share", "truncation_rate", "nonfinite"], "y": "share",
     "range": [0, 1.05]},
    {"id": "sandbox", "title": "Sandboxes per domain: cold-start share, retries after infrastructure failures, "
                               "runtime image builds waited for (count, longest seconds)",
     "names": ["sandbox_cold_share", "sandbox_retries", "sandbox_image_builds", "sandbox_build_s"],
     "y": "share / count / s", "sandbox": True},
    # Episodes of multi-turn domains, per domain, one unit per chart; ``episodes`` charts stay hidden on a run
    # without an environment domain (they would only ever be empty boxes there). Solve rate: "Pass rate".
    {"id": "ep_tools", "title": "Episodes: tool-call rate, tool and parse errors, environment share of tokens",
     "names": ["tool_call_rate", "tool_error_rate", "parse_error_rate", "env_token_share"], "y": "share",
     "range": [0, 1.05], "episodes": True},
    {"id": "ep_turns", "title": "Episode length: model turns per episode", "names": ["turns_mean"], "y": "turns",
     "episodes": True},
    {"id": "ep_tokens", "title": "Episode tokens: the model's and the environment's, per episode",
     "names": ["model_tokens_mean", "env_tokens_mean"], "y": "tokens", "episodes": True},
    {"id": "ep_stops", "title": "Episode stop reasons (share of episodes)", "names": [], "prefixes": ["stop_"],
     "y": "share", "range": [0, 1.05], "episodes": True},
    {"id": "ep_latency", "title": "Tool step and session start latency (p50/p95)", "names": [],
     "prefixes": ["tool_latency_s_", "session_start_s_"], "y": "seconds", "episodes": True},
    {"id": "other", "title": "Other metrics", "names": [], "other": True, "y": "value"},
]

# Metrics a comparison of runs can overlay (one chart each, a trace per run).
COMPARE_METRICS = ("heldout_reward", "reward_mean", "gpu_busy", "trajectories_per_s", "loss", "kl", "entropy",
                   "invalid_rate", "staleness_mean", "grad_norm", "clip_fraction", "tokens_per_s")


def sparkline_svg(values: Sequence[float], width: int = 120, height: int = 28) -> str:
    """An inline SVG polyline of ``values`` (no script, no library: the runs list stays light)."""
    if len(values) < 2:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    step = (width - 2) / (len(values) - 1)
    points = " ".join(
        f"{1 + i * step:.1f},{height - 2 - (v - lo) / span * (height - 4):.1f}" for i, v in enumerate(values)
    )
    return (f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'role="img" aria-label="reward from {values[0]:.2f} to {values[-1]:.2f}">'
            f'<polyline fill="none" stroke="currentColor" stroke-width="1.5" points="{points}"/></svg>')
