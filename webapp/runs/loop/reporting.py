"""What a finished train step reports: its metric points, read back from the database, then health checks
and the evaluation it is due for. Runs on the control queue (``report_step``), so the GPU worker goes back
to the device as soon as the step is recorded; a step is reported once (``PolicyVersion.metrics["reported"]``).

Every metric the trainer computes is reported (``TRAINER_METRICS``): loss, clipping, the KL to the
behaviour policy and to the base model, entropy, gradient norm, importance weights, what was trained and
what was dropped.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any

from django.db import transaction
from django.db.models import Count

from webapp.runs import services
from webapp.runs.loop import alerts, heldout, live
from webapp.runs.metrics import Point
from webapp.runs.models import PolicyVersion, PromptGroup, Run, Trajectory, VerdictChoice
from workers import messages
from workers.pipeline.scheduler import IN_FLIGHT
from workers.pipeline.spec import RunSpec

TRAINER_METRICS = (
    "loss", "clip_fraction", "kl", "kl_ref", "entropy", "grad_norm", "iw_mean", "iw_max", "iw_min", "tokens_trained",
    "samples_trained", "groups_used", "groups_dropped_zero_variance", "samples_dropped_invalid", "reward_mean",
    "advantage_abs_mean", "train_seconds", "train_task_seconds", "train_queue_wait_s")


def report_step(run_id: int, step: int) -> int:
    """Emit a recorded step's points once; then health checks and, every ``eval_every`` versions, evaluation."""
    with transaction.atomic():
        version = PolicyVersion.objects.select_for_update().filter(run_id=run_id, step=step, number__gt=0).first()
        run = Run.objects.filter(pk=run_id).first()
        if version is None or run is None or version.metrics.get("reported"):
            return 0
        PolicyVersion.objects.filter(pk=version.pk).update(metrics={**version.metrics, "reported": True})
        points = step_points(run, version)
        live.emit(run_id, points)
    alerts.check_run(run_id)
    spec = RunSpec.model_validate(run.spec)
    if spec.eval_every and version.number % spec.eval_every == 0:
        if (busy := heldout.sampling_now(run_id)) is None:
            messages.evaluate(run_id, version.number)
        else:  # a chunked evaluation is still taking turns with training: one at a time
            services.record_event(run_id, "evaluation.skipped",
                                  f"evaluation of v{version.number} skipped: v{busy[0]}'s is still sampling "
                                  f"({busy[1]} of {busy[2]} tasks)",
                                  data={"version": version.number, "sampling": busy[0]})
    return len(points)


def step_points(run: Run, version: PolicyVersion) -> list[Point]:
    """The metric points of train step ``version.step``: every trainer metric, data, stage timings, queues."""
    step, m = version.step, version.metrics
    points = [Point(name, step, float(m[name])) for name in TRAINER_METRICS if isinstance(m.get(name), (int, float))
              and not isinstance(m.get(name), bool)]
    points.append(Point("nonfinite", step, float(bool(m.get("nonfinite")))))
    groups = list(PromptGroup.objects.filter(run=run, trained_step=step, status=PromptGroup.Status.TRAINED).order_by())
    points.append(Point("zero_variance_share", step,
                        float(m.get("groups_dropped_zero_variance") or 0) / max(1, len(groups))))
    samples = list(Trajectory.objects.filter(run=run, trained_step=step).order_by().values_list(
        "domain_id", "version", "verdict", "reward", "finish_reason", "verify_latency_ms", "completion_token_ids"))
    total = len(samples)
    lags = [version.number - 1 - v for _, v, *_ in samples]
    points += [
        Point("invalid_rate", step, sum(s[2] == VerdictChoice.INVALID for s in samples) / max(1, total)),
        Point("truncation_rate", step, sum(s[4] == "length" for s in samples) / max(1, total)),
        Point("staleness_mean", step, statistics.fmean(lags) if lags else 0.0),
        Point("staleness_max", step, float(max(lags, default=0))),
    ]
    points += [Point(f"staleness_lag_{lag}", step, float(n)) for lag, n in sorted(Counter(lags).items())]
    rewards: defaultdict[int | None, list[float]] = defaultdict(list)
    latency: defaultdict[int | None, list[float]] = defaultdict(list)
    for sample_domain, _, _, reward, _, latency_ms, _ in samples:
        if reward is not None:
            rewards[sample_domain].append(reward)
        if latency_ms is not None:
            latency[sample_domain].append(latency_ms)
    for domain_id, values in rewards.items():
        points.append(Point("reward", step, statistics.fmean(values), domain_id=domain_id))
        points.append(Point("pass_rate", step, sum(r >= 1.0 for r in values) / len(values), domain_id=domain_id))
    for domain_id, values in latency.items():
        points.append(Point("verify_latency_ms_p50", step, quantile(values, 0.5), domain_id=domain_id))
        points.append(Point("verify_latency_ms_p95", step, quantile(values, 0.95), domain_id=domain_id))
    for name, attr in (("verify_queue_wait_s", "verify_wait_s"), ("verify_group_s", "verify_s")):
        per_domain: defaultdict[int | None, list[float]] = defaultdict(list)
        for g in groups:
            if getattr(g, attr) is not None:
                per_domain[g.domain_id].append(getattr(g, attr))
        for domain_id, values in per_domain.items():
            points.append(Point(f"{name}_p50", step, quantile(values, 0.5), domain_id=domain_id))
            points.append(Point(f"{name}_p95", step, quantile(values, 0.95), domain_id=domain_id))
    points += sandbox_points(run, step)
    # episodes of multi-turn domains: turns, tool calls and their errors, how much of the text the
    # environment wrote, why they stopped, and how long their sessions took to open (per domain)
    episodes: defaultdict[int | None, list[tuple[list[dict[str, Any]], str, int]]] = defaultdict(list)
    session_starts: defaultdict[int | None, list[float]] = defaultdict(list)
    for domain_id, turns, stop_reason, ids, start_s in (
            Trajectory.objects.filter(run=run, trained_step=step).exclude(stop_reason="").order_by()
            .values_list("domain_id", "turns", "stop_reason", "completion_token_ids", "sandbox__session_start_s")):
        episodes[domain_id].append((turns or [], stop_reason, len(ids or [])))
        if isinstance(start_s, (int, float)):  # None: the episode never opened its session
            session_starts[domain_id].append(float(start_s))
    # an episode may span versions: its staleness per sampled token, by the version that sampled each turn
    lagged = [(version.number - 1 - int(t["version"]), int(t["end"]) - int(t["start"]))
              for rows in episodes.values() for turns, _, _ in rows for t in turns
              if t.get("role") == "model" and t.get("version") is not None]
    if lagged:
        points.append(Point("staleness_token_mean", step,
                            sum(lag * n for lag, n in lagged) / max(1, sum(n for _, n in lagged))))
    for domain_id, rows in episodes.items():
        model_turns = [t for turns, _, _ in rows for t in turns if t.get("role") == "model"]
        env_turns = [t for turns, _, _ in rows for t in turns if t.get("role") == "env"]
        calls = [t for t in env_turns if t.get("tool")]
        tokens = sum(n for _, _, n in rows)
        env_tokens = sum(int(t["end"]) - int(t["start"]) for t in env_turns)
        model_tokens = sum(int(t["end"]) - int(t["start"]) for t in model_turns)
        points += [
            Point("turns_mean", step, len(model_turns) / len(rows), domain_id=domain_id),
            Point("model_tokens_mean", step, model_tokens / len(rows), domain_id=domain_id),
            Point("env_tokens_mean", step, env_tokens / len(rows), domain_id=domain_id),
            Point("tool_call_rate", step, sum(any(t.get("tool") for t in turns) for turns, _, _ in rows) / len(rows),
                  domain_id=domain_id),
            Point("tool_error_rate", step, sum(t.get("status") in ("tool_error", "timeout") for t in calls)
                  / max(1, len(calls)), domain_id=domain_id),
            Point("parse_error_rate", step, sum(t.get("status") == "parse_error" for t in env_turns)
                  / max(1, len(model_turns)), domain_id=domain_id),
            Point("env_token_share", step, env_tokens / max(1, tokens), domain_id=domain_id),
        ]
        for reason, n in Counter(stop for _, stop, _ in rows).items():
            points.append(Point(f"stop_{reason}", step, n / len(rows), domain_id=domain_id))
        latencies = [float(t.get("latency_s") or 0.0) for t in calls]
        if latencies:
            points.append(Point("tool_latency_s_p50", step, quantile(latencies, 0.5), domain_id=domain_id))
            points.append(Point("tool_latency_s_p95", step, quantile(latencies, 0.95), domain_id=domain_id))
        if starts := session_starts.get(domain_id):
            points.append(Point("session_start_s_p50", step, quantile(starts, 0.5), domain_id=domain_id))
            points.append(Point("session_start_s_p95", step, quantile(starts, 0.95), domain_id=domain_id))
    generated = sum(g.generate_s for g in groups if g.generate_s is not None)
    if generated > 0:
        tokens = sum(len(s[6] or []) for s in samples)
        points += [Point("generate_seconds", step, generated), Point("tokens_per_s", step, tokens / generated),
                   Point("trajectories_per_s", step, total / generated)]
    waits = [g.generate_wait_s for g in groups if g.generate_wait_s is not None]
    if waits:
        points.append(Point("generate_queue_wait_s", step, statistics.fmean(waits)))
    stages = (*IN_FLIGHT, "ready")  # read alone: counting every group grew with the run
    counts = dict(PromptGroup.objects.filter(run=run, status__in=stages).values_list("status")
                  .annotate(n=Count("id")).order_by())
    for status in stages:
        points.append(Point(f"groups_{status}", step, float(counts.get(status, 0))))
    points.append(Point("in_flight", step, float(sum(counts.get(s, 0) for s in IN_FLIGHT))))
    window = run.state.get("step_window")  # [previous step's end, this step's end], wall clock
    if window and window[1] > window[0] and run.step == step:
        points.append(Point("gpu_busy", step, min(1.0, live.take_busy(run.pk) / (window[1] - window[0]))))
    return points


def sandbox_points(run: Run, step: int) -> list[Point]:
    """Per domain, from where its sandboxed verdicts ran (``sandbox_call.sandbox_facts``): the share of cold
    starts (an execution that started its runtime's zygote), the retries after infrastructure failures, and
    the image builds executions waited for (count, and the longest in seconds)."""
    rows = (Trajectory.objects.filter(run=run, trained_step=step, verifier_details__has_key="sandbox_start")
            .order_by().values_list("domain_id", "verifier_details__sandbox_start",
                                    "verifier_details__sandbox_attempts", "verifier_details__image_build_s"))
    per_domain: defaultdict[int | None, list[tuple[Any, Any, Any]]] = defaultdict(list)
    for row_domain, start, attempts, build_s in rows:
        per_domain[row_domain].append((start, attempts, build_s))
    points = []
    for domain_id, facts in per_domain.items():
        builds = [float(b) for _, _, b in facts if isinstance(b, (int, float)) and b > 0]
        points += [
            Point("sandbox_cold_share", step, sum(s == "cold" for s, _, _ in facts) / len(facts), domain_id=domain_id),
            Point("sandbox_retries", step, float(sum(max(0, int(a) - 1) for _, a, _ in facts if isinstance(a, int))),
                  domain_id=domain_id),
            Point("sandbox_image_builds", step, float(len(builds)), domain_id=domain_id),
            Point("sandbox_build_s", step, max(builds, default=0.0), domain_id=domain_id),
        ]
    return points


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
