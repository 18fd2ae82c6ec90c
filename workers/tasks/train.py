"""Train-queue task (GPU worker): one GRPO step on B ready groups, then save policy version v+1."""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from collections import defaultdict

from workers.celery import app

log = logging.getLogger(__name__)


@app.task(name="workers.tasks.train.train_step")
def train_step(run_id: int, step: int) -> str:
    """Train step ``step`` of a run. Idempotent: a finished step is skipped; a redelivered one re-finds its groups."""
    from webapp.runs import pipeline, services
    from webapp.runs.metrics import Point
    from webapp.runs.models import Run, RunEvent, RunStatus, Verdict
    from workers.pipeline.spec import RunSpec
    from workers.policy.engines import Sample
    from workers.policy.trainer import Group, TrainerConfig
    from workers.tasks import resident
    from workers.tasks.control import advance_run
    from workers.tasks.rollout import evaluate
    from workers.telemetry import emit

    run = Run.objects.select_related("base_model").filter(pk=run_id).first()
    if run is None or run.step >= step:
        return "already done"
    spec = RunSpec.model_validate(run.spec)
    limits = pipeline.limits_for(spec)
    if run.status not in (RunStatus.RUNNING, RunStatus.PAUSING):
        pipeline.release_train_claim(run_id)
        return f"run is {run.status}"
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
    trainer = resident.trainer_for(run_id, pipeline.resolve_model_path(run.base_model), config,
                                   pipeline.version_dir(run_id, run.latest_version), run.latest_version, run.step)
    batch: list[Group] = []
    per_domain: defaultdict[int | None, list[float]] = defaultdict(list)
    lags: list[int] = []
    invalid = truncated = total = 0
    for group in groups:
        samples: list[Sample] = []
        rewards: list[float | None] = []
        for t in pipeline.group_trajectories(group):
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
        batch.append(Group(samples=samples, rewards=rewards))
    started = time.monotonic()
    metrics = trainer.train_step(batch)
    out = pipeline.version_dir(run_id, run.latest_version + 1)
    assert out is not None
    spec_hash = hashlib.sha256(json.dumps(run.spec, sort_keys=True).encode()).hexdigest()[:16]
    trainer.save_version(out, spec_hash=spec_hash)
    seconds = time.monotonic() - started
    busy = pipeline.take_busy(run_id) + seconds
    last_step_at = run.state.get("last_step_at")
    now = time.time()
    m = metrics.as_dict()
    version = pipeline.finish_train_step(run, step, groups, version_path=out, finished_at=now,
                                         metrics={k: v for k, v in m.items() if isinstance(v, (int, float, bool))})
    points = [Point(name, step, float(m[name])) for name in (
        "loss", "clip_fraction", "kl", "entropy", "grad_norm", "iw_mean", "iw_max", "tokens_trained", "reward_mean")]
    points += [
        Point("train_seconds", step, seconds),
        Point("zero_variance_share", step, metrics.groups_dropped_zero_variance / max(1, len(groups))),
        Point("invalid_rate", step, invalid / max(1, total)),
        Point("staleness_mean", step, statistics.fmean(lags) if lags else 0.0),
        Point("staleness_max", step, float(max(lags, default=0))),
    ]
    for domain_id, domain_rewards in per_domain.items():
        points.append(Point("reward", step, statistics.fmean(domain_rewards), domain_id=domain_id))
        points.append(Point("pass_rate", step, sum(r >= 1.0 for r in domain_rewards) / len(domain_rewards),
                            domain_id=domain_id))
    if last_step_at:
        points.append(Point("gpu_busy", step, min(1.0, busy / max(1e-9, now - last_step_at))))
    emit(run_id, points)
    if metrics.collapsed:
        services.record_event(run_id, "alert.collapse", f"training collapsed at step {step}: {metrics.collapse_reason}",
                              level=RunEvent.Level.WARNING, data={"step": step})
        if spec.auto_pause_on_collapse:
            services.do_pause_run(Run.objects.get(pk=run_id))
    if spec.eval_every and version.number % spec.eval_every == 0:
        evaluate.delay(run_id, version.number)
    advance_run.delay(run_id)
    return f"v{version.number}"
