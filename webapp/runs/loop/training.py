"""Training (the GPU worker): claim B ready groups, assemble the batch, train one GRPO step, save version
v+1 and record it — and the trainer's facts about every sample — in one transaction.

Advantages are computed here, where the batch is assembled (``losses.sample_advantages`` with the run's
estimator), written to ``Trajectory.advantage`` and handed to the trainer, which stays blind to the
estimator; after the step each trained sample's ``clipped`` says whether any of its tokens hit the PPO
clip. The step's next scheduling decision is taken in-process (``tick.advance``), so the next messages are
queued before the device is free; metrics, health and evaluation are ``report_step``'s, on the control
queue.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from webapp.runs.loop import live, paths, tick
from webapp.runs.models import PolicyVersion, PromptGroup, Run, RunStatus, Trajectory, VerdictChoice
from workers import messages
from workers.pipeline.spec import RunSpec

G = PromptGroup.Status
TRAIN_CLAIM_KEYS = ("train_claim", "train_claim_at", "train_holder", "train_held_at")
SAMPLE_FIELDS = ("prompt", "prompt_token_ids", "completion_token_ids", "completion", "behaviour_logprobs",
                 "finish_reason", "version", "verdict", "reward", "turns")


def loss_mask(turns: list[dict[str, Any]], n: int) -> list[int] | None:
    """An episode's loss mask from its turns: 1 on the model's spans, 0 on the environment's (None for a
    single turn: every completion token was sampled)."""
    if not turns:
        return None
    mask = [0] * n
    for turn in turns:
        if turn["role"] == "model":
            mask[int(turn["start"]):int(turn["end"])] = [1] * (int(turn["end"]) - int(turn["start"]))
    return mask


def finite(metrics: dict[str, Any]) -> dict[str, Any]:
    """The trainer's scalar metrics, JSON-safe: NaN and infinity become None (PostgreSQL's jsonb refuses
    them); lists and nested values are left out."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, (bool, int, str)):
            out[k] = v
        elif isinstance(v, float):
            out[k] = v if math.isfinite(v) else None
    return out


def claim_batch(run: Run, step: int, batch: int, holder: str = "") -> list[PromptGroup]:
    """Claim B ready groups for train step ``step`` (or re-find them when this step is redelivered).
    ``holder`` is recorded on the run, so a worker known gone mid-step has the step re-sent at once."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().filter(pk=run.pk).first()
        if locked is not None and holder and locked.state.get("train_claim") == step:
            Run.objects.filter(pk=run.pk).update(state={**locked.state, "train_holder": holder,
                                                        "train_held_at": time.time()})
        claimed = list(PromptGroup.objects.filter(run=run, status=G.TRAINING, trained_step=step))
        if not claimed:
            ids = list(PromptGroup.objects.filter(run=run, status=G.READY).order_by("id")
                       .values_list("id", flat=True)[:batch])
            if len(ids) < batch:
                return []
            PromptGroup.objects.filter(pk__in=ids, status=G.READY).update(
                status=G.TRAINING, trained_step=step, updated_at=timezone.now())
            claimed = list(PromptGroup.objects.filter(pk__in=ids, status=G.TRAINING, trained_step=step))
    return claimed


def release_claim(run_id: int) -> None:
    """Forget a train claim that will not be carried out (nothing ready, or the run stopped)."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run_id)
        if "train_claim" in locked.state:
            Run.objects.filter(pk=run_id).update(state={k: v for k, v in locked.state.items()
                                                        if k not in TRAIN_CLAIM_KEYS})


def batch_trajectories(run_id: int, groups: list[PromptGroup], *fields: str) -> dict[str, list[Trajectory]]:
    """The samples of several groups in one query, by group key, in sample order."""
    qs = Trajectory.objects.filter(run_id=run_id, group_key__in=[g.key for g in groups])
    if fields:
        qs = qs.only("group_key", "sample_index", *fields)
    out: dict[str, list[Trajectory]] = {g.key: [] for g in groups}
    for t in qs.order_by("group_key", "sample_index"):
        out[t.group_key].append(t)
    return out


def finish(run: Run, step: int, groups: list[PromptGroup], *, version_path: Path, metrics: dict[str, Any],
           finished_at: float, facts: dict[int, tuple[float | None, bool | None]] | None = None) -> PolicyVersion:
    """Record version ``latest+1``, mark the groups and their samples trained (with each sample's advantage
    and clip, ``facts``) and advance the run, in one transaction: whoever sees the step sees its samples'
    facts."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        if locked.step >= step:
            # A duplicate delivery of this step (two GPU workers, or a re-issued claim) finished first:
            # record nothing twice.
            return PolicyVersion.objects.get(run=run, step=step)
        number = locked.latest_version + 1
        parent = PolicyVersion.objects.filter(run=run, number=locked.latest_version).first()
        version, _ = PolicyVersion.objects.get_or_create(
            run=run, number=number,
            defaults={"parent": parent, "step": step, "path": str(version_path), "metrics": metrics})
        # A run that ended while this step trained (its target reached on an evaluation) dropped the step's
        # groups as unfinished; the step did train on them and its version is recorded, so they are trained.
        PromptGroup.objects.filter(pk__in=[g.pk for g in groups], trained_step=step,
                                   status__in=(G.TRAINING, G.DROPPED)).update(
            status=G.TRAINED, drop_reason="", holder="", updated_at=timezone.now())
        Trajectory.objects.filter(run=run, group_key__in=[g.key for g in groups]).update(trained_step=step)
        record_sample_facts(facts or {})
        state = dict(locked.state)
        for key in TRAIN_CLAIM_KEYS:
            state.pop(key, None)
        state.pop("failures", None)  # the loop made progress: earlier task failures were transient
        # wall clock of the last two steps: the GPU-busy fraction's window
        state["step_window"] = [state.get("last_step_at") or finished_at, finished_at]
        state["last_step_at"] = finished_at
        Run.objects.filter(pk=run.pk).update(step=step, latest_version=number, state=state, updated_at=timezone.now())
    return version


def record_sample_facts(facts: dict[int, tuple[float | None, bool | None]]) -> None:
    """Each trained sample's advantage and whether it was clipped: one prepared statement run for every row
    (``executemany``, ~1 ms for a step). The ORM's ``bulk_update`` built a model object and a CASE branch per
    row, a tenth of the GPU worker's time, so it was written after the step's messages, where a test could
    read the finished run before it."""
    if not facts:
        return
    table = connection.ops.quote_name(Trajectory._meta.db_table)
    with connection.cursor() as cursor:
        cursor.executemany(f"UPDATE {table} SET advantage = %s, clipped = %s WHERE id = %s",
                           [(advantage, clipped, tid) for tid, (advantage, clipped) in facts.items()])


def run_step(run_id: int, step: int, holder: str) -> int | None:
    """Claim, train, save and record step ``step``; the new version's number (None when nothing was done).
    A rollout task of this run in this process waits meanwhile (``resident.training``): prompts admitted
    while it trains are meant for the version it produces."""
    from workers.policy import resident

    with resident.training(run_id):
        version = _run_step(run_id, step, holder)
    if version is None:
        return None
    # Claim the next step and admit the next prompts right here rather than through the control queue: the
    # messages are queued before this task ends, so the device does not wait for a round trip.
    messages.report_step(run_id, step)
    tick.advance(run_id)
    return version


def _run_step(run_id: int, step: int, holder: str) -> int | None:
    from workers.policy import resident
    from workers.policy.engines import Sample
    from workers.policy.losses import sample_advantages
    from workers.policy.trainer import Group, TrainerConfig

    task_started, wall_started = time.monotonic(), time.time()
    run = Run.objects.select_related("base_model").filter(pk=run_id).first()
    if run is None or run.step >= step:
        return None
    spec = RunSpec.model_validate(run.spec)
    if run.status not in (RunStatus.RUNNING, RunStatus.PAUSING):
        release_claim(run_id)
        return None
    claimed_at = run.state.get("train_claim_at")
    groups = claim_batch(run, step, spec.pipeline.batch_prompts, holder)
    if not groups:
        release_claim(run_id)
        messages.advance_run(run_id)
        return None
    a = spec.algorithm
    config = TrainerConfig(
        advantage=a.advantage, lr=a.learning_rate, clip_low=a.clip_low, clip_high=a.clip_high, kl_coef=a.kl_coef,
        max_grad_norm=a.max_grad_norm, num_minibatches=a.updates_per_batch, micro_batch_size=a.micro_batch_size,
        lora_rank=a.lora_rank, lora_alpha=a.lora_alpha, loss_aggregation=a.loss_aggregation,
        temperature=spec.sampling.temperature or 1.0, collapse_patience=spec.collapse_window, seed=spec.seed)
    samples_of = batch_trajectories(run_id, groups, *SAMPLE_FIELDS)
    batch, rows = [], []
    for g in groups:
        trajectories = samples_of[g.key]
        rewards = [None if t.verdict == VerdictChoice.INVALID else t.reward for t in trajectories]
        advantages = sample_advantages(rewards, a.advantage)
        batch.append(Group(samples=[Sample(prompt=t.prompt, prompt_token_ids=t.prompt_token_ids,
                                           completion_token_ids=t.completion_token_ids, text=t.completion,
                                           logprobs=t.behaviour_logprobs,
                                           finish_reason="length" if t.finish_reason == "length" else "stop",
                                           version=t.version,
                                           mask=loss_mask(t.turns, len(t.completion_token_ids)))
                                    for t in trajectories],
                           rewards=rewards, advantages=advantages))
        rows.append([(t.pk, adv) for t, adv in zip(trajectories, advantages, strict=True)])
    out = paths.version_dir(run_id, run.latest_version + 1)
    assert out is not None
    spec_hash = hashlib.sha256(json.dumps(run.spec, sort_keys=True).encode()).hexdigest()[:16]
    with live.on_device(run_id) as timer:
        trainer = resident.trainer_for(run_id, paths.resolve_model_path(run.base_model), config,
                                       paths.version_dir(run_id, run.latest_version), run.latest_version, run.step)
        metrics = trainer.train_step(batch)
        trainer.save_version(out, spec_hash=spec_hash)
    where = resident.placement()
    clipped = set(metrics.clipped_samples)
    metrics.clipped_samples = []
    facts: dict[int, tuple[float | None, bool | None]] = {}
    for gi, group in enumerate(rows):
        used = any(adv not in (None, 0.0) for _, adv in group)  # a group without signal is not trained on
        for si, (tid, adv) in enumerate(group):
            facts[tid] = (adv, (gi, si) in clipped if used and adv is not None else None)
    step_facts = {
        **metrics.as_dict(), "train_seconds": timer.seconds, "train_task_seconds": time.monotonic() - task_started,
        "train_queue_wait_s": max(0.0, wall_started - float(claimed_at)) if claimed_at else None,
        "nonfinite": bool(metrics.collapse_reason and "non-finite" in metrics.collapse_reason),
        "device": where.device, "dtype": where.dtype,
    }
    version = finish(run, step, groups, version_path=out, finished_at=time.time(), metrics=finite(step_facts),
                     facts=facts)
    return version.number
