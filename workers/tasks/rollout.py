"""Rollout-queue tasks (GPU worker): generate a batch of groups under the newest version; evaluate a version."""

from __future__ import annotations

import logging
from typing import Any

from workers.celery import app

log = logging.getLogger(__name__)


def _sampling(spec: Any, n: int, greedy: bool = False) -> Any:
    from workers.policy.engines import SamplingSpec

    s = spec.sampling
    return SamplingSpec(n=n, temperature=0.0 if greedy else s.temperature, top_p=1.0 if greedy else s.top_p,
                        max_tokens=s.max_tokens, stop=tuple(s.stop))


@app.task(name="workers.tasks.rollout.generate", ignore_result=True)
def generate(run_id: int, group_ids: list[int]) -> int:
    """Sample G completions for each claimed group, write them, and hand each group to verification."""
    from django.utils import timezone

    from webapp.runs import pipeline
    from webapp.runs.models import PromptGroup, Run, RunStatus
    from workers.pipeline.spec import RunSpec
    from workers.tasks import resident
    from workers.tasks.control import advance_run
    from workers.tasks.health import this_worker
    from workers.tasks.verify import verify_batch

    run = Run.objects.select_related("base_model").filter(pk=run_id).first()
    if run is None:
        return 0
    if run.status in (RunStatus.CANCELLED, RunStatus.FAILED, RunStatus.COMPLETED):
        PromptGroup.objects.filter(pk__in=group_ids, status=PromptGroup.Status.ADMITTED).update(
            status=PromptGroup.Status.DROPPED, drop_reason=f"run {run.status} before generation")
        return 0
    groups = pipeline.claim_groups(group_ids, PromptGroup.Status.ADMITTED, PromptGroup.Status.GENERATING,
                                   holder=this_worker())
    if not groups:
        return 0
    claimed_at = timezone.now()
    spec = RunSpec.model_validate(run.spec)
    group_size = spec.pipeline.group_size
    resident.after_training(run_id)
    with resident.device(run_id) as timer:  # switching to the newest version is device work too
        # the newest version now that this task holds the device (a train step may just have finished)
        latest = Run.objects.filter(pk=run_id).values_list("latest_version", flat=True).get()
        engine = resident.engine_for(run.engine, pipeline.resolve_model_path(run.base_model), seed=spec.seed)
        resident.serve(engine, run_id, latest, pipeline.version_dir(run.pk, latest))  # this run's version
        prompts = [g.domain.render_prompt(g.task.prompt, g.task.reference, g.task.metadata) if g.task and g.domain
                   else "" for g in groups]
        samples = engine.generate(prompts, _sampling(spec, group_size))
    rows = [
        pipeline.SampleRow(group_id=groups[i // group_size].pk, index=i % group_size, prompt=s.prompt,
                           completion=s.text, prompt_token_ids=s.prompt_token_ids,
                           completion_token_ids=s.completion_token_ids, logprobs=s.logprobs,
                           finish_reason=s.finish_reason, version=s.version)
        for i, s in enumerate(samples)
    ]
    waits = [(claimed_at - g.created_at).total_seconds() for g in groups]
    pipeline.write_samples(run_id, {g.pk: g for g in groups}, rows, generate_s=timer.seconds,
                           wait_s=sum(waits) / len(waits))
    # One message hands the batch to the verify queue, which fans it out: the GPU worker goes back to the
    # device at once, and every group is judged as soon as a verify worker is free.
    verify_batch.apply_async((run_id, [g.pk for g in groups], [g.attempt for g in groups]),
                             task_id=pipeline.verify_task_id(run_id, groups[0].pk, groups[0].attempt))
    advance_run.delay(run_id)
    return len(samples)


@app.task(name="workers.tasks.rollout.evaluate", ignore_result=True)
def evaluate(run_id: int, version: int) -> int:
    """Held-out evaluation of one version of a run, the device half: sample every domain's held-out tasks.

    Greedy, or ``n_samples`` completions per task when an evaluation was requested that way (pass@k). The
    completions are stored as evaluation samples (``Trajectory.is_eval``) and scored on the verify queue
    (``score_evaluation``), so a slow verifier never holds the GPU worker. Version 0 is the base model.
    """
    from webapp.catalog.models import Task
    from webapp.runs import pipeline
    from webapp.runs.models import Evaluation, PolicyVersion, Run, RunStatus, Trajectory
    from workers.pipeline.spec import RunSpec
    from workers.tasks import resident
    from workers.tasks.verify import score_evaluation

    run = Run.objects.select_related("base_model").filter(pk=run_id).first()
    if run is None or run.status in (RunStatus.CANCELLED, RunStatus.FAILED):
        return 0
    if version == 0:  # the base model: a version row of its own, so it can be compared with
        version_row, _ = PolicyVersion.objects.get_or_create(run=run, number=0, defaults={"step": 0})
    elif (found := PolicyVersion.objects.filter(run=run, number=version).first()) is not None:
        version_row = found
    else:
        return 0
    spec = RunSpec.model_validate(run.spec)
    k = max(Evaluation.objects.filter(version=version_row, suite="heldout", status=Evaluation.Status.PENDING)
            .values_list("n_samples", flat=True), default=1)
    per_domain = []
    for rd in run.run_domains.select_related("domain"):
        tasks = list(Task.objects.filter(domain=rd.domain, split=Task.Split.HELDOUT).order_by("id")[: spec.eval_tasks])
        if tasks:
            per_domain.append((rd, tasks))
    tasks = [t for _, domain_tasks in per_domain for t in domain_tasks]
    with resident.device(run_id):  # every domain's prompts in one batch
        engine = resident.engine_for(run.engine, pipeline.resolve_model_path(run.base_model), seed=spec.seed)
        resident.serve(engine, run_id, version, pipeline.version_dir(run.pk, version))
        prompts = [rd.domain.render_prompt(t.prompt, t.reference, t.metadata) for rd, domain_tasks in per_domain
                   for t in domain_tasks]
        outputs = engine.generate(prompts, _sampling(spec, k, greedy=k == 1)) if tasks else []
    Trajectory.objects.bulk_create([
        Trajectory(run=run, task=t, domain_id=t.domain_id, group_key=pipeline.eval_key(version, k, t.pk),
                   sample_index=i % k, version=version, prompt=s.prompt, completion=s.text,
                   prompt_token_ids=s.prompt_token_ids, completion_token_ids=s.completion_token_ids,
                   finish_reason=s.finish_reason, is_eval=True)
        for i, (t, s) in enumerate(zip((t for t in tasks for _ in range(k)), outputs, strict=True))
    ], ignore_conflicts=True)
    for rd, domain_tasks in per_domain:
        Evaluation.objects.update_or_create(version=version_row, domain=rd.domain, suite="heldout", defaults={
            "status": Evaluation.Status.RUNNING, "n_tasks": len(domain_tasks), "n_samples": k})
    score_evaluation.delay(run_id, version, k)
    return len(outputs)
