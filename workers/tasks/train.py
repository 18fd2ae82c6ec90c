"""Train-queue task (GPU worker): one GRPO step on B ready groups, then save policy version v+1.

The GPU worker does the step, records it (version, trained groups) in one transaction and takes the
run's next scheduling decision itself (``advance_run`` in-process), so the next step's work is queued
before the device is free. Everything else about the step — metrics, health checks, evaluation — is left
to ``report_step`` on the control queue, which reads it back from the database.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from typing import Any

from workers.celery import app

log = logging.getLogger(__name__)

SAMPLE_FIELDS = ("prompt", "prompt_token_ids", "completion_token_ids", "completion", "behaviour_logprobs",
                 "finish_reason", "version", "verdict", "reward")


def finite(metrics: dict[str, Any]) -> dict[str, Any]:
    """The trainer's numeric metrics, JSON-safe: NaN and infinity become None (PostgreSQL's jsonb refuses them)."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, (bool, int, str)):
            out[k] = v
        elif isinstance(v, float):
            out[k] = v if math.isfinite(v) else None
    return out


@app.task(name="workers.tasks.train.train_step", ignore_result=True)
def train_step(run_id: int, step: int) -> str:
    """Train step ``step`` of a run. Idempotent: a finished step is skipped; a redelivered one re-finds its groups."""
    from workers.tasks import resident
    from workers.tasks.control import advance_run, report_step

    with resident.training(run_id):  # a rollout task of this run in this process waits for the new version
        version = _train_step(run_id, step)
    if version is None:
        return "nothing done"
    report_step.delay(run_id, step)
    # Claim the next step and admit the next prompts right here rather than through the control queue:
    # the messages are queued before this task ends, so the device does not wait for a round trip.
    advance_run(run_id)
    return f"v{version}"


def _train_step(run_id: int, step: int) -> int | None:
    """Claim, train, save and record step ``step``; the new version's number (None when nothing was done)."""
    from webapp.runs import pipeline
    from webapp.runs.models import Run, RunStatus, Verdict
    from workers.pipeline.spec import RunSpec
    from workers.policy.engines import Sample
    from workers.policy.trainer import Group, TrainerConfig
    from workers.tasks import resident
    from workers.tasks.control import advance_run
    from workers.tasks.health import this_worker

    task_started, wall_started = time.monotonic(), time.time()
    run = Run.objects.select_related("base_model").filter(pk=run_id).first()
    if run is None or run.step >= step:
        return None
    spec = RunSpec.model_validate(run.spec)
    limits = pipeline.limits_for(spec)
    if run.status not in (RunStatus.RUNNING, RunStatus.PAUSING):
        pipeline.release_train_claim(run_id)
        return None
    claimed_at = run.state.get("train_claim_at")
    groups = pipeline.claim_train_batch(run, step, limits.batch_groups, limits.max_staleness, holder=this_worker())
    if not groups:
        pipeline.release_train_claim(run_id)
        advance_run.delay(run_id)
        return None
    a = spec.algorithm
    config = TrainerConfig(
        advantage=a.advantage, lr=a.learning_rate, clip_low=a.clip_low, clip_high=a.clip_high, kl_coef=a.kl_coef,
        max_grad_norm=a.max_grad_norm, num_minibatches=a.updates_per_batch, micro_batch_size=a.micro_batch_size,
        lora_rank=a.lora_rank, lora_alpha=a.lora_alpha, temperature=spec.sampling.temperature or 1.0,
        collapse_patience=spec.collapse_window, seed=spec.seed,
    )
    samples_of = pipeline.batch_trajectories(run_id, groups, *SAMPLE_FIELDS)
    batch = [
        Group(samples=[Sample(prompt=t.prompt, prompt_token_ids=t.prompt_token_ids,
                              completion_token_ids=t.completion_token_ids, text=t.completion,
                              logprobs=t.behaviour_logprobs,
                              finish_reason="length" if t.finish_reason == "length" else "stop", version=t.version)
                       for t in samples_of[g.key]],
              rewards=[None if t.verdict == Verdict.INVALID else t.reward for t in samples_of[g.key]])
        for g in groups
    ]
    out = pipeline.version_dir(run_id, run.latest_version + 1)
    assert out is not None
    spec_hash = hashlib.sha256(json.dumps(run.spec, sort_keys=True).encode()).hexdigest()[:16]
    with resident.device(run_id) as timer:
        trainer = resident.trainer_for(run_id, pipeline.resolve_model_path(run.base_model), config,
                                       pipeline.version_dir(run_id, run.latest_version), run.latest_version, run.step)
        metrics = trainer.train_step(batch)
        trainer.save_version(out, spec_hash=spec_hash)
    facts = {
        **metrics.as_dict(), "train_seconds": timer.seconds, "train_task_seconds": time.monotonic() - task_started,
        "train_queue_wait_s": max(0.0, wall_started - float(claimed_at)) if claimed_at else None,
        "nonfinite": bool(metrics.collapse_reason and "non-finite" in metrics.collapse_reason),
        "device": resident.placement().device, "dtype": resident.placement().dtype,
    }
    version = pipeline.finish_train_step(run, step, groups, version_path=out, finished_at=time.time(),
                                         metrics=finite(facts))
    return version.number
