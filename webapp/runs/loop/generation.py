"""Generation (the GPU worker): claim a batch of admitted groups, sample G completions for each under the
run's newest version, write them, and hand the batch to verification.

Prompts are rendered by their domain (``TaskDomain.render_prompt``: the template, the system prompt, the
kind's visible fields); the trajectory stores the rendered text and the exact token ids. Writing is
idempotent on ``(run, group_key, sample_index)``, and the groups move to verifying in one statement per
sample count, so a redelivered task writes nothing twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.utils import timezone

from webapp.runs.loop import live, paths
from webapp.runs.loop.tick import wake_deferred
from webapp.runs.models import TERMINAL_STATUSES, PromptGroup, Run, Trajectory
from workers import messages
from workers.pipeline.spec import RunSpec

G = PromptGroup.Status
ENDED = TERMINAL_STATUSES


def sampling(spec: RunSpec, n: int, greedy: bool = False) -> Any:
    """The engine's sampling parameters for ``n`` samples per prompt (greedy for evaluation)."""
    from workers.policy.engines import SamplingParams

    s = spec.sampling
    return SamplingParams(n=n, temperature=0.0 if greedy else s.temperature, top_p=1.0 if greedy else s.top_p,
                          max_tokens=s.max_tokens, stop=tuple(s.stop))


def claim(group_ids: list[int], holder: str) -> list[PromptGroup]:
    """admitted → generating, held by ``holder`` (a redelivered task finds nothing left to claim)."""
    PromptGroup.objects.filter(pk__in=group_ids, status=G.ADMITTED).update(
        status=G.GENERATING, holder=holder, updated_at=timezone.now())
    return list(PromptGroup.objects.filter(pk__in=group_ids, status=G.GENERATING).select_related("task", "domain"))


@dataclass(frozen=True)
class SampleRow:
    group_id: int
    index: int
    prompt: str
    completion: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int


def write_samples(run_id: int, groups: dict[int, PromptGroup], rows: list[SampleRow], *,
                  generate_s: float | None = None, wait_s: float | None = None) -> None:
    """Write trajectories (idempotent on (run, group, index)) and move their groups to verifying.

    ``generate_s`` (the task's device seconds) is shared out over the groups and ``wait_s`` (their mean
    wait for a rollout task) stored on each: the train step reports both, so generation sends no message.
    """
    with transaction.atomic():
        Trajectory.objects.bulk_create([
            Trajectory(run_id=run_id, task_id=groups[r.group_id].task_id, domain_id=groups[r.group_id].domain_id,
                       group_key=groups[r.group_id].key, sample_index=r.index, version=r.version, prompt=r.prompt,
                       completion=r.completion, prompt_token_ids=r.prompt_token_ids,
                       completion_token_ids=r.completion_token_ids, behaviour_logprobs=r.logprobs,
                       finish_reason=r.finish_reason)
            for r in rows
        ], ignore_conflicts=True)
        # one statement for every group of the batch: G samples each, all under the same version
        per_group: dict[int, int] = {}
        for r in rows:
            per_group[r.group_id] = per_group.get(r.group_id, 0) + 1
        version = rows[0].version if rows else 0
        share = None if generate_s is None else generate_s / max(1, len(per_group))
        for n in set(per_group.values()):
            PromptGroup.objects.filter(pk__in=[g for g, k in per_group.items() if k == n], status=G.GENERATING).update(
                status=G.VERIFYING, n_samples=n, generated_version=version, generate_s=share, generate_wait_s=wait_s,
                holder="", updated_at=timezone.now())


def load_engine(run: Run, spec: RunSpec) -> Any:
    """The run's resident engine, loaded on the device on first use. The load is charged to no run: it
    is a one-off of the worker, and would otherwise count against a run's fair share."""
    from workers.policy import resident

    with resident.DEVICE:
        return resident.engine_for(run.engine, paths.resolve_model_path(run.base_model), seed=spec.seed)


def generate(run_id: int, group_ids: list[int], holder: str) -> int:
    """Sample G completions for each claimed group, write them, and hand the batch to verification."""
    from workers.policy import resident

    run = Run.objects.select_related("base_model").filter(pk=run_id).first()
    if run is None:
        return 0
    if run.status in ENDED:
        PromptGroup.objects.filter(pk__in=group_ids, status=G.ADMITTED).update(
            status=G.DROPPED, drop_reason=f"run {run.status} before generation")
        return 0
    groups = claim(group_ids, holder)
    if not groups:
        return 0
    claimed_at = timezone.now()
    spec = RunSpec.model_validate(run.spec)
    group_size = spec.pipeline.group_size
    resident.after_training(run_id)
    prompts = [g.domain.render_prompt(g.task.prompt, g.task.reference, g.task.metadata) if g.task and g.domain
               else "" for g in groups]
    engine = load_engine(run, spec)
    with live.on_device(run_id) as timer:  # switching to the newest version is device work too
        # the newest version now that this task holds the device (a train step may just have finished)
        latest = Run.objects.filter(pk=run_id).values_list("latest_version", flat=True).get()
        resident.serve(engine, run_id, latest, paths.version_dir(run.pk, latest))  # this run's own version
        samples = engine.generate(prompts, sampling(spec, group_size))
    rows = [SampleRow(group_id=groups[i // group_size].pk, index=i % group_size, prompt=s.prompt,
                      completion=s.text, prompt_token_ids=s.prompt_token_ids,
                      completion_token_ids=s.completion_token_ids, logprobs=s.logprobs,
                      finish_reason=s.finish_reason, version=s.version)
            for i, s in enumerate(samples)]
    waits = [(claimed_at - g.created_at).total_seconds() for g in groups]
    write_samples(run_id, {g.pk: g for g in groups}, rows, generate_s=timer.seconds, wait_s=sum(waits) / len(waits))
    # One message hands the batch to the verify queue, which fans it out: the GPU worker goes back to the
    # device at once, and every group is judged as soon as a verify worker is free.
    messages.verify_batch(run_id, [g.pk for g in groups], [g.attempt for g in groups])
    messages.advance_run(run_id)
    wake_deferred(except_run=run_id)
    return len(samples)
