"""Train-queue task (GPU worker): one GRPO step on B ready groups, then save policy version v+1."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from workers.celery import app

log = logging.getLogger(__name__)

SAMPLE_FIELDS = ("prompt", "prompt_token_ids", "completion_token_ids", "completion", "behaviour_logprobs",
                 "finish_reason", "version", "verdict", "reward", "verify_latency_ms")


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@app.task(name="workers.tasks.train.train_step", ignore_result=True)
def train_step(run_id: int, step: int) -> str:
    """Train step ``step`` of a run. Idempotent: a finished step is skipped; a redelivered one re-finds its groups."""
    from django.db.models import Count

    from webapp.runs import pipeline
    from webapp.runs.metrics import Point
    from webapp.runs.models import PromptGroup, Run, RunStatus, Verdict
    from workers.pipeline.spec import RunSpec
    from workers.policy.engines import Sample
    from workers.policy.trainer import Group, TrainerConfig
    from workers.tasks import resident
    from workers.tasks.control import advance_run
    from workers.tasks.health import check_run_health
    from workers.tasks.rollout import evaluate
    from workers.telemetry import busy, emit

    task_started, wall_started = time.monotonic(), time.time()
    run = Run.objects.select_related("base_model").filter(pk=run_id).first()
    if run is None or run.step >= step:
        return "already done"
    spec = RunSpec.model_validate(run.spec)
    limits = pipeline.limits_for(spec)
    if run.status not in (RunStatus.RUNNING, RunStatus.PAUSING):
        pipeline.release_train_claim(run_id)
        return f"run is {run.status}"
    claimed_at = run.state.get("train_claim_at")
    groups = pipeline.claim_train_batch(run, step, limits.batch_groups, limits.max_staleness)
    if not groups:
        pipeline.release_train_claim(run_id)
        advance_run.delay(run_id)
        return "nothing ready"
    a = spec.algorithm
    config = TrainerConfig(
        advantage=a.advantage, lr=a.learning_rate, clip_low=a.clip_low, clip_high=a.clip_high, kl_coef=a.kl_coef,
        max_grad_norm=a.max_grad_norm, num_minibatches=a.updates_per_batch, micro_batch_size=a.micro_batch_size,
        lora_rank=a.lora_rank, lora_alpha=a.lora_alpha, temperature=spec.sampling.temperature or 1.0,
        collapse_patience=spec.collapse_window, seed=spec.seed,
    )
    samples_of = pipeline.batch_trajectories(run_id, groups, *SAMPLE_FIELDS)
    batch: list[Group] = []
    per_domain: defaultdict[int | None, list[float]] = defaultdict(list)
    latency: defaultdict[int | None, list[float]] = defaultdict(list)
    lags: list[int] = []
    invalid = truncated = total = 0
    for group in groups:
        samples: list[Sample] = []
        rewards: list[float | None] = []
        for t in samples_of[group.key]:
            samples.append(Sample(prompt=t.prompt, prompt_token_ids=t.prompt_token_ids,
                                  completion_token_ids=t.completion_token_ids, text=t.completion,
                                  logprobs=t.behaviour_logprobs,
                                  finish_reason="length" if t.finish_reason == "length" else "stop",
                                  version=t.version))
            rewards.append(None if t.verdict == Verdict.INVALID else t.reward)
            invalid += t.verdict == Verdict.INVALID
            truncated += t.finish_reason == "length"
            total += 1
            lags.append(run.latest_version - t.version)
            if t.reward is not None:
                per_domain[group.domain_id].append(t.reward)
            if t.verify_latency_ms is not None:
                latency[group.domain_id].append(t.verify_latency_ms)
        batch.append(Group(samples=samples, rewards=rewards))
    out = pipeline.version_dir(run_id, run.latest_version + 1)
    assert out is not None
    spec_hash = hashlib.sha256(json.dumps(run.spec, sort_keys=True).encode()).hexdigest()[:16]
    with busy(run_id) as timer:
        trainer = resident.trainer_for(run_id, pipeline.resolve_model_path(run.base_model), config,
                                       pipeline.version_dir(run_id, run.latest_version), run.latest_version, run.step)
        metrics = trainer.train_step(batch)
        trainer.save_version(out, spec_hash=spec_hash)
    seconds = timer.seconds
    gpu_busy = pipeline.take_busy(run_id)
    last_step_at = run.state.get("last_step_at")
    now = time.time()
    m = metrics.as_dict()
    version = pipeline.finish_train_step(run, step, groups, version_path=out, finished_at=now,
                                         metrics={k: v for k, v in m.items() if isinstance(v, (int, float, bool))})
    points = [Point(name, step, float(m[name])) for name in (
        "loss", "clip_fraction", "kl", "entropy", "grad_norm", "iw_mean", "iw_max", "tokens_trained", "reward_mean")]
    nonfinite = bool(metrics.collapse_reason and "non-finite" in metrics.collapse_reason)
    points += [
        Point("train_seconds", step, seconds),
        Point("train_task_seconds", step, time.monotonic() - task_started),
        Point("nonfinite", step, float(nonfinite)),
        Point("zero_variance_share", step, metrics.groups_dropped_zero_variance / max(1, len(groups))),
        Point("invalid_rate", step, invalid / max(1, total)),
        Point("staleness_mean", step, statistics.fmean(lags) if lags else 0.0),
        Point("staleness_max", step, float(max(lags, default=0))),
    ]
    points += [Point(f"staleness_lag_{lag}", step, float(n)) for lag, n in sorted(Counter(lags).items())]
    if claimed_at:
        points.append(Point("train_queue_wait_s", step, max(0.0, wall_started - float(claimed_at))))
    for domain_id, domain_rewards in per_domain.items():
        points.append(Point("reward", step, statistics.fmean(domain_rewards), domain_id=domain_id))
        points.append(Point("pass_rate", step, sum(r >= 1.0 for r in domain_rewards) / len(domain_rewards),
                            domain_id=domain_id))
    for domain_id, values in latency.items():
        points.append(Point("verify_latency_ms_p50", step, quantile(values, 0.5), domain_id=domain_id))
        points.append(Point("verify_latency_ms_p95", step, quantile(values, 0.95), domain_id=domain_id))
    points += stage_points(step, groups)
    generated = [g.generate_s for g in groups if g.generate_s is not None]
    if generated and sum(generated) > 0:
        tokens = sum(len(t.completion_token_ids) for ts in samples_of.values() for t in ts)
        points += [Point("generate_seconds", step, sum(generated)),
                   Point("tokens_per_s", step, tokens / sum(generated)),
                   Point("trajectories_per_s", step, total / sum(generated))]
    waits = [g.generate_wait_s for g in groups if g.generate_wait_s is not None]
    if waits:
        points.append(Point("generate_queue_wait_s", step, statistics.fmean(waits)))
    points.append(Point("truncation_rate", step, truncated / max(1, total)))
    counts = dict(PromptGroup.objects.filter(run_id=run_id).values_list("status").annotate(n=Count("id")))
    for status in ("admitted", "generating", "verifying", "ready"):
        points.append(Point(f"groups_{status}", step, float(counts.get(status, 0))))
    points.append(Point("in_flight", step, float(sum(counts.get(s, 0) for s in ("admitted", "generating", "verifying")))))
    if last_step_at:
        points.append(Point("gpu_busy", step, min(1.0, gpu_busy / max(1e-9, now - last_step_at))))
    emit(run_id, points)
    check_run_health(run_id)
    if spec.eval_every and version.number % spec.eval_every == 0:
        evaluate.delay(run_id, version.number)
    advance_run.delay(run_id)
    return f"v{version.number}"


def stage_points(step: int, groups: Sequence[Any]) -> list[Any]:
    """Verification timings of the trained groups: queue wait and judging time, p50/p95 per domain."""
    from webapp.runs.metrics import Point

    waits: defaultdict[int | None, list[float]] = defaultdict(list)
    spans: defaultdict[int | None, list[float]] = defaultdict(list)
    for g in groups:
        if g.verify_wait_s is not None and math.isfinite(g.verify_wait_s):
            waits[g.domain_id].append(g.verify_wait_s)
        if g.verify_s is not None:
            spans[g.domain_id].append(g.verify_s)
    points = []
    for domain_id, values in waits.items():
        points.append(Point("verify_queue_wait_s_p50", step, quantile(values, 0.5), domain_id=domain_id))
        points.append(Point("verify_queue_wait_s_p95", step, quantile(values, 0.95), domain_id=domain_id))
    for domain_id, values in spans.items():
        points.append(Point("verify_group_s_p50", step, quantile(values, 0.5), domain_id=domain_id))
        points.append(Point("verify_group_s_p95", step, quantile(values, 0.95), domain_id=domain_id))
    return points
