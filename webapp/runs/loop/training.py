"""Training (the GPU worker): claim B ready groups, assemble the batch, train one GRPO step, save version
v+1 and record it — and the trainer's facts about every sample — in one transaction.

Advantages are computed where the batch is assembled (``resident.train``: ``losses.sample_advantages`` with
the run's estimator, on the device's side), written to ``Trajectory.advantage`` and handed to the trainer,
which stays blind to the estimator; after the step each trained sample's ``clipped`` says whether any of its
tokens hit the PPO clip. With a device process a step is confirmed as it is queued there, so the run's next
rollout queues right behind it under the version it makes (``_run_step``). The step's next scheduling
decision is taken in-process, in the transaction that records it (``tick.advance_holding_train``): a next
step it claims is trained by the same task at once (``run_step``), and the other messages are queued before
the device is free; metrics, health and evaluation are ``report_step``'s, on the control queue.

A step can also be *trained ahead* (``plan_ahead``, ``queue_ahead``, ``conclude_ahead``): on an on-policy
run whose verdicts the device gives as it generates, the generate task queues the batch's step on the device
right behind its rollout, and records it once the scheduler has claimed it over those very groups.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from webapp.runs.loop import live, paths, tick
from webapp.runs.loop.accounting import domain_key
from webapp.runs.loop.tick import limits_for
from webapp.runs.loop.verification import judged_inline
from webapp.runs.models import PolicyVersion, PromptGroup, Run, RunStatus, Trajectory, VerdictChoice
from workers import messages
from workers.pipeline.spec import RunSpec
from workers.policy import resident

log = logging.getLogger(__name__)
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
    """Claim B ready groups for train step ``step`` (or re-find them when this step is redelivered), the
    oldest first, in id order (the batch's order: which samples share a minibatch).
    ``holder`` is recorded on the run, so a worker known gone mid-step has the step re-sent at once."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().filter(pk=run.pk).first()
        if locked is not None and holder and locked.state.get("train_claim") == step:
            Run.objects.filter(pk=run.pk).update(state={**locked.state, "train_holder": holder,
                                                        "train_held_at": time.time()})
        claimed = list(PromptGroup.objects.filter(run=run, status=G.TRAINING, trained_step=step).order_by("id"))
        if not claimed:
            ids = list(PromptGroup.objects.filter(run=run, status=G.READY).order_by("id")
                       .values_list("id", flat=True)[:batch])
            if len(ids) < batch:
                return []
            PromptGroup.objects.filter(pk__in=ids, status=G.READY).update(
                status=G.TRAINING, trained_step=step, updated_at=timezone.now())
            claimed = list(PromptGroup.objects.filter(pk__in=ids, status=G.TRAINING, trained_step=step).order_by("id"))
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
           finished_at: float, facts: dict[int, tuple[float | None, bool | None]] | None = None,
           on_recorded: Callable[[], None] | None = None, then: Callable[[], None] | None = None) -> PolicyVersion:
    """Record version ``latest+1``, mark the groups and their samples trained (with each sample's advantage
    and clip, ``facts``) and advance the run, in one transaction: whoever sees the step sees its samples'
    facts. When this call records it (not a duplicate's), ``on_recorded`` runs once that transaction has
    committed, before any other callback of it, and ``then`` (the run's next decision) runs inside it."""
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
        marked = dict(PromptGroup.objects.filter(pk__in=[g.pk for g in groups], trained_step=step,
                                                 status__in=(G.TRAINING, G.DROPPED)).values_list("id", "domain_id"))
        trained = dict(locked.trained_groups)
        for domain_id in marked.values():
            key = domain_key(domain_id)
            trained[key] = trained.get(key, 0) + 1
        PromptGroup.objects.filter(pk__in=list(marked)).update(status=G.TRAINED, drop_reason="", holder="",
                                                                updated_at=timezone.now())
        Trajectory.objects.filter(run=run, group_key__in=[g.key for g in groups]).update(trained_step=step)
        record_sample_facts(facts or {})
        state = dict(locked.state)
        for key in TRAIN_CLAIM_KEYS:
            state.pop(key, None)
        state.pop("failures", None)  # the loop made progress: earlier task failures were transient
        # wall clock of the last two steps: the GPU-busy fraction's window
        state["step_window"] = [state.get("last_step_at") or finished_at, finished_at]
        state["last_step_at"] = finished_at
        Run.objects.filter(pk=run.pk).update(step=step, latest_version=number, state=state, trained_groups=trained,
                                             updated_at=timezone.now())
        if on_recorded is not None:
            transaction.on_commit(on_recorded)
        if then is not None:
            then()
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


def run_step(run_id: int, step: int, holder: str, go_on: Callable[[], bool] = lambda: True) -> int | None:
    """Claim, train, save and record step ``step``; the new version's number (None when nothing was done).
    A rollout task of this run in this process waits meanwhile (``resident.training``): prompts admitted
    while it trains are meant for the version it produces (with a device process, not for long: see
    ``_run_step``).

    The run's next decision is taken as the step is recorded, in the same transaction, and a next step it
    claims (a batch was ready by then) is held by this worker and trained by this task at once, and so on
    while batches are ready and ``go_on()`` (False once the worker is shutting down: the step claimed is
    then sent to the train queue): the device gets the next step without a broker round trip and a task
    of its own."""
    first: int | None = None
    sent, next_step = step, step  # type: int, int | None
    while next_step is not None:
        step, next_step = next_step, None
        if step != sent and not go_on():
            messages.train_step(run_id, step)
            return first
        try:
            with resident.training(run_id, exclusive=True) as under_way:
                if under_way is None:
                    # This process trains a step of the run already (this step: its message delivered twice,
                    # or re-sent while a step trained ahead was being recorded). A second copy would train it
                    # again beside the first and save over its version's files; the first records it, or its
                    # failure re-sends it.
                    log.info("run %s: train step %s is under way in this process already; not trained twice",
                             run_id, step)
                    if step != sent:  # claimed here, as another step was recorded: nobody was sent it
                        messages.train_step(run_id, step, countdown=1.0)
                    return first
                version, next_step = _run_step(run_id, step, holder, under_way)
            if version is None:
                return first
            first = version if first is None else first
        except Exception:
            # The failure handler re-sends this task's own step, not one claimed here: those are sent now (a
            # step that was recorded meanwhile does nothing when it comes)
            with contextlib.suppress(Exception):
                for claimed in (step if step != sent else None, next_step):
                    if claimed is not None:
                        messages.train_step(run_id, claimed, countdown=2.0)
            raise
    return first


def after_step(run_id: int, step: int) -> None:
    """A recorded step's report (control queue), and the run's next decision taken right here rather than
    through the control queue: the next messages are queued before this task ends, so the device does not
    wait for a round trip."""
    messages.report_step(run_id, step)
    tick.advance(run_id)


def trainer_config(spec: RunSpec) -> Any:
    """The run's ``TrainerConfig``."""
    from workers.policy.steps import TrainerConfig

    a = spec.algorithm
    return TrainerConfig(
        advantage=a.advantage, lr=a.learning_rate, clip_low=a.clip_low, clip_high=a.clip_high, kl_coef=a.kl_coef,
        max_grad_norm=a.max_grad_norm, num_minibatches=a.updates_per_batch, micro_batch_size=a.micro_batch_size,
        lora_rank=a.lora_rank, lora_alpha=a.lora_alpha, loss_aggregation=a.loss_aggregation,
        temperature=spec.sampling.temperature or 1.0, collapse_patience=spec.collapse_window, seed=spec.seed)


def train_sample(t: Trajectory) -> Any:
    """A stored sample as the trainer takes it."""
    from workers.policy.engines import Sample

    return Sample(prompt=t.prompt, prompt_token_ids=t.prompt_token_ids, completion_token_ids=t.completion_token_ids,
                  text=t.completion, logprobs=t.behaviour_logprobs,
                  finish_reason="length" if t.finish_reason == "length" else "stop", version=t.version,
                  mask=loss_mask(t.turns, len(t.completion_token_ids)))


def spec_hash(run: Run) -> str:
    return hashlib.sha256(json.dumps(run.spec, sort_keys=True).encode()).hexdigest()[:16]


def _run_step(run_id: int, step: int, holder: str,
              handle: resident.TrainStep | None = None) -> tuple[int | None, int | None]:
    """``run_step``'s work: the version recorded (None when nothing was done), and the next step the decision
    taken as it was recorded claimed for this task (held by ``holder``; None when none).

    With ``handle`` (this step's ``resident.training``) and a device process, the step is confirmed as soon
    as it is queued on the device: the run's next rollout, admitted for the version it makes (async mode
    admits ahead), is queued right behind it and samples from that version, instead of waiting for the
    step's result and record (the device idled ~50 ms a step for it in ``bench/pipeline.py``). Its samples
    are written once the version is recorded (``handle.ok``), and none if it is not
    (``generation.given_up``). Without ``handle`` the step is recorded alone, and the caller takes the next
    decision."""
    task_started, wall_started = time.monotonic(), time.time()
    run = Run.objects.select_related("base_model").filter(pk=run_id).first()
    if run is None or run.step >= step:
        return None, None
    spec = RunSpec.model_validate(run.spec)
    if run.status not in (RunStatus.RUNNING, RunStatus.PAUSING):
        release_claim(run_id)
        return None, None
    claimed_at = run.state.get("train_claim_at")
    groups = claim_batch(run, step, spec.pipeline.batch_prompts, holder)
    if not groups:
        release_claim(run_id)
        messages.advance_run(run_id)
        return None, None
    samples_of = batch_trajectories(run_id, groups, *SAMPLE_FIELDS)
    batch = [([train_sample(t) for t in samples_of[g.key]],
              [None if t.verdict == VerdictChoice.INVALID else t.reward for t in samples_of[g.key]]) for g in groups]
    out = paths.version_dir(run_id, run.latest_version + 1)
    assert out is not None
    train = (run_id, paths.resolve_model_path(run.base_model), trainer_config(spec),
             (run_id, run.latest_version, paths.version_dir(run_id, run.latest_version)), run.step, batch, out,
             spec_hash(run))
    with live.on_device(run_id) as timer:
        try:
            if handle is not None and resident.can_queue():
                future = resident.submit_train(*train)
                handle.confirm(step, run.latest_version + 1, out)
                result = resident.wait(future)
            else:
                result = resident.train(*train)
        except Exception:
            # What the step left of the trainer is not to be trusted (it may have stepped, then failed to save):
            # the retry rebuilds it from the run's newest saved version.
            with contextlib.suppress(Exception):
                resident.drop_trainer(run_id)
            raise
    recorded = partial(record, run, step, groups, [[t.pk for t in samples_of[g.key]] for g in groups], result, out,
                       device_s=timer.seconds, task_s=time.monotonic() - task_started,
                       queue_wait_s=max(0.0, wall_started - float(claimed_at)) if claimed_at else None)
    if handle is None:
        return recorded(), None
    claimed: int | None = None
    decided = False

    def decide() -> None:
        """The run's next decision, right after the step's record, a step it claims held for this task."""
        nonlocal claimed, decided
        try:
            with transaction.atomic():  # a savepoint: a decision that fails does not undo the record
                claimed = tick.advance_holding_train(run_id, holder)
            decided = True
        except Exception:
            log.warning("run %s: the decision after step %s failed; handed to the control queue", run_id, step,
                        exc_info=True)

    def mark_ok() -> None:  # samples of its version may be written (``resident.training`` sets ``recorded``)
        handle.ok = True

    number = recorded(on_recorded=mark_ok)
    # the step's report is queued before the decision, which may complete the run: a run seen completed has
    # its last step's report on its way first, as before
    messages.report_step(run_id, step)
    if not holder:
        tick.advance(run_id)
        return number, None
    decide()
    if not decided:
        messages.advance_run(run_id)
    return number, claimed


def record(run: Run, step: int, groups: list[PromptGroup], ids: list[list[int]], result: Any, out: Path, *,
           device_s: float, task_s: float, queue_wait_s: float | None, ahead: bool = False,
           on_recorded: Callable[[], None] | None = None, then: Callable[[], None] | None = None) -> int:
    """Record a trained step (``finish``, with ``result``, a ``steps.StepResult``, and its ``on_recorded`` and
    ``then``) and the trainer's facts about each sample (``ids``: per group, its samples' trajectory ids); the
    new version's number."""
    where = resident.placement()
    metrics = result.metrics
    clipped = set(metrics.clipped_samples)
    metrics.clipped_samples = []
    facts: dict[int, tuple[float | None, bool | None]] = {}
    for gi, (tids, advantages) in enumerate(zip(ids, result.advantages, strict=True)):
        used = any(adv not in (None, 0.0) for adv in advantages)  # a group without signal is not trained on
        for si, (tid, adv) in enumerate(zip(tids, advantages, strict=True)):
            facts[tid] = (adv, (gi, si) in clipped if used and adv is not None else None)
    step_facts = {
        **metrics.as_dict(), "train_seconds": device_s, "train_task_seconds": task_s,
        "train_queue_wait_s": queue_wait_s, "trained_ahead": ahead,
        "nonfinite": bool(metrics.collapse_reason and "non-finite" in metrics.collapse_reason),
        "device": where.device, "dtype": where.dtype,
    }
    version = finish(run, step, groups, version_path=out, finished_at=time.time(), metrics=finite(step_facts),
                     facts=facts, on_recorded=on_recorded, then=then)
    return version.number


# ------------------------------------------------------------------------------------- training ahead


@dataclass
class Ahead:
    """A train step queued on the device right behind its own rollout, before its rows are written and before
    the scheduler has claimed it (``plan_ahead``)."""

    base: tuple[int, int, Path | None]
    """(run, version, directory) it trains from, and the rollout samples from."""
    base_step: int
    out: Path
    """Where it saves the version it makes (number ``base[1] + 1``)."""
    order: list[int]
    """The rollout's prompts in the order of their groups' ids (the batch's order, as ``claim_batch``'s)."""
    group_ids: list[int]
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    future: Future[Any] | None = None
    leave: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    handle: Any = None
    """``resident.training``'s step, once ``enter``: the run's next rollout waits on it."""
    started: float = field(default_factory=time.monotonic)
    charged: bool = False
    """Its device seconds are charged to the run (``live.account_busy``): once only."""

    @property
    def step(self) -> int:
        """The step it will be, if the scheduler claims it over these groups."""
        return self.base_step + 1

    @property
    def version(self) -> int:
        return self.base[1] + 1

    def enter(self) -> None:
        self.handle = self.leave.enter_context(resident.training(self.base[0]))


def plan_ahead(run: Run, spec: RunSpec, groups: list[PromptGroup], trained: Any) -> Ahead | None:
    """Whether this rollout batch's train step can be queued on the device right behind the rollout, and
    from which version: when the scheduler can only claim exactly this batch next. The run is on-policy
    (``max_staleness`` 0: nothing else is in flight) and running, the batch is one train batch, each of its
    groups is judged as it is generated (single-turn, a string verifier), and no step is claimed but the one
    this process trains and has confirmed (``trained``, ``resident.after_training``: then this one follows it,
    from the version it makes). Whether every prompt fit and every verdict is valid is known only after the
    rollout: the device trains only then, and ``conclude_ahead`` records the step only if the scheduler
    claims it over these very groups.

    *Why:* on-policy, the device otherwise waits between a rollout and its step for the batch to be judged,
    its rows written, the step claimed, its message sent and the batch read back, and the next rollout waits
    for the version to be recorded (~50 ms a step on the demo run, a fifth of it). None when it does not
    apply, and in a worker without a device process."""
    if not resident.can_queue() or limits_for(spec).max_staleness != 0:
        return None
    if len(groups) != spec.pipeline.batch_prompts or not all(judged_inline(g) for g in groups):
        return None
    status, step, latest, state = Run.objects.filter(pk=run.pk).values_list(
        "status", "step", "latest_version", "state").get()
    if status != RunStatus.RUNNING:
        return None
    claim = state.get("train_claim")
    if trained is not None:
        if claim != trained.step:
            return None
        base, base_step = (run.pk, trained.version[0], trained.version[1]), trained.step
    elif claim:
        return None
    else:
        base, base_step = (run.pk, latest, paths.version_dir(run.pk, latest)), step
    order = sorted(range(len(groups)), key=lambda i: groups[i].pk)
    out = paths.version_dir(run.pk, base[1] + 1)
    assert out is not None
    return Ahead(base=base, base_step=base_step, out=out, order=order,
                 group_ids=[groups[i].pk for i in order])


def queue_ahead(run: Run, spec: RunSpec, ahead: Ahead) -> None:
    """Queue the step on the device behind the rollout that kept its batch (``rollout_async(keep=token)``)."""
    ahead.future = resident.train_async(run.pk, paths.resolve_model_path(run.base_model), trainer_config(spec),
                                        ahead.base, ahead.base_step, (ahead.token, ahead.order), ahead.out,
                                        spec_hash(run))


def conclude_ahead(run_id: int, ahead: Ahead, claimed: int | None, eligible: bool, holder: str) -> int | None:
    """After the batch's rows are written with the scheduler's decision (``tick.advance_holding_train``:
    ``claimed``, a train step held here, or None). The step trained ahead is recorded if the device trained it
    (``eligible``: every prompt fit and every verdict is valid) and the claim is its step over its groups;
    otherwise it is given up (its trainer dropped, to be rebuilt from the newest saved version) and a claimed
    step is trained the usual way, here. On an error the claim goes to the train queue. The recorded
    version's number, or None."""
    version = None
    try:
        run = Run.objects.select_related("base_model").get(pk=run_id)
        spec = RunSpec.model_validate(run.spec)
        groups = (claim_batch(run, claimed, spec.pipeline.batch_prompts, holder)
                  if eligible and claimed == ahead.step else [])
        if groups and [g.pk for g in groups] == ahead.group_ids:
            ahead.handle.confirm(ahead.step, ahead.version, ahead.out)  # the next rollout may ask for it now
            version = _record_ahead(run, ahead, groups)
        else:
            give_up(run_id, ahead)
            if claimed is not None:
                version = _run_step(run_id, claimed, holder)[0]
    except Exception:
        with contextlib.suppress(Exception):
            give_up(run_id, ahead)
        if claimed is not None and version is None:
            messages.train_step(run_id, claimed)
        raise
    finally:
        ahead.leave.close()
    if version is not None:
        assert claimed is not None
        after_step(run_id, claimed)
    return version


def _record_ahead(run: Run, ahead: Ahead, groups: list[PromptGroup]) -> int:
    assert ahead.future is not None
    result, seconds, cpu = resident.result(ahead.future)
    if result is None:
        raise RuntimeError(f"the device process did not train step {ahead.step} ahead, though its batch was whole")
    live.account_busy(run.pk, seconds, cpu)
    ahead.charged = True
    ids = {(key, index): tid for key, index, tid in Trajectory.objects.filter(
        run_id=run.pk, group_key__in=[g.key for g in groups]).values_list("group_key", "sample_index", "id")}
    return record(run, ahead.step, groups,
                  [[ids[(g.key, i)] for i in range(len(advantages))]
                   for g, advantages in zip(groups, result.advantages, strict=True)],
                  result, ahead.out, device_s=seconds, task_s=time.monotonic() - ahead.started, queue_wait_s=0.0,
                  ahead=True, on_recorded=partial(setattr, ahead.handle, "ok", True))  # its samples may be written


def give_up(run_id: int, ahead: Ahead) -> None:
    """Wait for a step queued ahead to leave the device; if it trained, drop the trainer it moved on."""
    if ahead.future is None:
        return
    try:
        result, seconds, cpu = resident.result(ahead.future)
    except Exception:  # it failed on the device: what it left of the trainer is not to be trusted
        result, seconds, cpu = True, 0.0, 0.0
    if result is not None:
        if not ahead.charged:  # a step whose record failed was charged already
            live.account_busy(run_id, seconds, cpu)
        with contextlib.suppress(Exception):  # a device process that died has no trainer left anyway
            resident.drop_trainer(run_id)
