"""What a train step reports of its episodes, per environment domain (``reporting.step_points``), from stored
trajectories in the real database: turns, the model's and the environment's tokens, tool use and errors,
stop reasons, tool step latency and session start latency."""

from __future__ import annotations

from typing import Any

import pytest

from tests import factories
from webapp.runs.loop.reporting import step_points
from webapp.runs.models import PolicyVersion, Trajectory

pytestmark = pytest.mark.django_db


def turn(role: str, start: int, end: int, **extra: Any) -> dict[str, Any]:
    return {"role": role, "text": "", "start": start, "end": end, "status": "ok", "latency_s": 0.0, **extra}


def test_a_step_reports_its_episodes_per_domain(user: Any) -> None:
    run = factories.run(user, name="episodes")
    single = run.run_domains.get().domain
    tool = factories.domain(user, "tool", verifier_row=single.verifier, environment="python_tool")
    version = PolicyVersion.objects.create(run=run, number=1, step=1, metrics={"loss": 0.5})
    episodes = [  # (turns, stop reason, the session's start latency or None when it never opened)
        ([turn("model", 0, 5), turn("env", 5, 9, tool="python", latency_s=0.01), turn("model", 9, 12)], "done", 0.02),
        ([turn("model", 0, 4)], "done", None),
        ([turn("model", 0, 6), turn("env", 6, 10, tool="python", status="tool_error", latency_s=0.03)],
         "max_turns", 0.04),
        ([turn("model", 0, 2), turn("env", 2, 4, tool="python", latency_s=0.02), turn("model", 4, 6)], "done", 0.03),
    ]
    for i, (turns, stop, start_s) in enumerate(episodes):
        Trajectory.objects.create(
            run=run, domain=tool, group_key="g", sample_index=i, version=0, prompt="p", completion="c",
            completion_token_ids=list(range(turns[-1]["end"])), turns=turns, stop_reason=stop, reward=1.0,
            verdict="pass", trained_step=1, sandbox={} if start_s is None else {"session_start_s": start_s})
    Trajectory.objects.create(run=run, domain=single, group_key="s", sample_index=0, version=0, prompt="p",
                              completion="c", completion_token_ids=[1, 2, 3], reward=0.0, verdict="fail",
                              trained_step=1)

    points = {(p.name, p.domain_id): p.value for p in step_points(run, version)}
    assert points[("turns_mean", tool.pk)] == pytest.approx(6 / 4)
    assert points[("model_tokens_mean", tool.pk)] == pytest.approx((5 + 3 + 4 + 6 + 2 + 2) / 4)
    assert points[("env_tokens_mean", tool.pk)] == pytest.approx((4 + 0 + 4 + 2) / 4)
    assert points[("tool_call_rate", tool.pk)] == pytest.approx(3 / 4)
    assert points[("tool_error_rate", tool.pk)] == pytest.approx(1 / 3)
    assert points[("stop_done", tool.pk)] == pytest.approx(3 / 4)
    assert points[("stop_max_turns", tool.pk)] == pytest.approx(1 / 4)
    assert points[("tool_latency_s_p50", tool.pk)] == pytest.approx(0.02)
    assert points[("tool_latency_s_p95", tool.pk)] == pytest.approx(0.03)
    # only the three episodes that opened a session count for its start latency
    assert points[("session_start_s_p50", tool.pk)] == pytest.approx(0.03)
    assert points[("session_start_s_p95", tool.pk)] == pytest.approx(0.04)
    # a single-turn domain has no episode points at all
    episode_names = {"turns_mean", "model_tokens_mean", "env_tokens_mean", "session_start_s_p50", "tool_call_rate"}
    assert not {name for name, domain in points if domain == single.pk} & episode_names
    assert points[("pass_rate", tool.pk)] == 1.0 and points[("pass_rate", single.pk)] == 0.0


def test_every_episode_point_has_a_chart_of_its_unit() -> None:
    """The episode points land in the episode charts, none in "Other metrics", each chart of one unit."""
    from webapp.ui.charts import CHARTS

    charts = {c["id"]: c for c in CHARTS if c.get("episodes")}
    assert set(charts) == {"ep_tools", "ep_turns", "ep_tokens", "ep_stops", "ep_latency"}

    def chart_of(name: str) -> str:
        return next(c["id"] for c in CHARTS if name in c["names"]
                    or any(name.startswith(p) for p in c.get("prefixes", [])))

    assert {chart_of(n) for n in ("tool_call_rate", "tool_error_rate", "parse_error_rate", "env_token_share")} \
        == {"ep_tools"}
    assert chart_of("turns_mean") == "ep_turns"
    assert {chart_of(n) for n in ("model_tokens_mean", "env_tokens_mean")} == {"ep_tokens"}
    assert {chart_of(n) for n in ("stop_done", "stop_max_turns")} == {"ep_stops"}
    assert {chart_of(n) for n in ("tool_latency_s_p95", "session_start_s_p50")} == {"ep_latency"}
