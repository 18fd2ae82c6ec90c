"""Rollout-queue tasks (GPU worker): generate a batch of groups under the newest version; evaluate a version."""

from __future__ import annotations

import logging
import statistics
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
    from workers.tasks.verify import verify_batch
    from workers.telemetry import busy

    run = Run.objects.select_related("base_model").filter(pk=run_id).first()
    if run is None:
        return 0
    if run.status in (RunStatus.CANCELLED, RunStatus.FAILED, RunStatus.COMPLETED):
        PromptGroup.objects.filter(pk__in=group_ids, status=PromptGroup.Status.ADMITTED).update(
            status=PromptGroup.Status.DROPPED, drop_reason=f"run {run.status} before generation")
        return 0
    groups = pipeline.claim_groups(group_ids, PromptGroup.Status.ADMITTED, PromptGroup.Status.GENERATING)
    if not groups:
        return 0
    claimed_at = timezone.now()
    spec = RunSpec.model_validate(run.spec)
    engine = resident.engine_for(run.engine, pipeline.resolve_model_path(run.base_model), seed=spec.seed)
    group_size = spec.pipeline.group_size
    with busy(run_id) as timer:  # switching to the newest version is device work too
        if engine.version != run.latest_version:
            engine.set_version(pipeline.version_dir(run.pk, run.latest_version))
        samples = engine.generate([g.task.prompt if g.task else "" for g in groups], _sampling(spec, group_size))
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


@app.task(name="workers.tasks.rollout.evaluate")
def evaluate(run_id: int, version: int) -> dict[str, float]:
    """Greedy held-out evaluation of one version of a run, per domain; completes the run at its target."""
    from webapp.catalog.models import Task
    from webapp.runs import pipeline, services
    from webapp.runs.metrics import Point
    from webapp.runs.models import Evaluation, PolicyVersion, Run, RunStatus
    from workers.pipeline.spec import RunSpec
    from workers.tasks import resident
    from workers.tasks.control import advance_run
    from workers.tasks.verify import judge
    from workers.telemetry import busy, emit

    run = Run.objects.select_related("base_model").filter(pk=run_id).first()
    if run is None or run.status in (RunStatus.CANCELLED, RunStatus.FAILED):
        return {}
    spec = RunSpec.model_validate(run.spec)
    engine = resident.engine_for(run.engine, pipeline.resolve_model_path(run.base_model), seed=spec.seed)
    with busy(run_id):
        engine.set_version(pipeline.version_dir(run.pk, version))
    version_row = PolicyVersion.objects.filter(run=run, number=version).first()
    scores: dict[str, float] = {}
    points = []
    weights = []
    step = version_row.step if version_row else 0
    per_domain = []
    for rd in run.run_domains.select_related("domain__verifier"):
        tasks = list(Task.objects.filter(domain=rd.domain, split=Task.Split.HELDOUT).order_by("id")[: spec.eval_tasks])
        if tasks:
            per_domain.append((rd, tasks))
    prompts = [t.prompt for _, tasks in per_domain for t in tasks]
    with busy(run_id):  # every domain's prompts in one batch
        outputs = engine.generate(prompts, _sampling(spec, 1, greedy=True)) if prompts else []
    offset = 0
    for rd, tasks in per_domain:
        samples = outputs[offset:offset + len(tasks)]
        offset += len(tasks)
        verdicts = [judge(rd.domain.verifier, t.prompt, s.text, t.reference) for t, s in zip(tasks, samples, strict=True)]
        valid = [v for v in verdicts if v.status != "invalid"]
        score = statistics.fmean(v.score or 0.0 for v in valid) if valid else 0.0
        pass_rate = sum(v.status == "pass" for v in valid) / max(1, len(valid))
        if version_row is not None:
            Evaluation.objects.update_or_create(
                version=version_row, domain=rd.domain, suite="heldout",
                defaults={"status": Evaluation.Status.DONE, "n_tasks": len(tasks), "score": score,
                          "pass_rate": pass_rate, "invalid_count": len(verdicts) - len(valid),
                          "results": {"greedy": True}})
        scores[rd.domain.name] = score
        weights.append((score, rd.weight))
        points.append(Point("heldout_reward", step, score, domain_id=rd.domain_id))
    if weights:
        overall = sum(s * w for s, w in weights) / sum(w for _, w in weights)
        scores["overall"] = overall
        points.append(Point("heldout_reward", step, overall))
        emit(run_id, points)
        if version_row is not None:
            PolicyVersion.objects.filter(pk=version_row.pk).update(metrics={**version_row.metrics, "heldout": scores})
        if (spec.target_reward is not None and version > 0 and overall >= spec.target_reward
                and run.status == RunStatus.RUNNING):
            services.do_complete_run(run, f"held-out reward {overall:.3f} reached the target {spec.target_reward}")
            advance_run.delay(run_id)  # drops what the completed run still had in flight, with the reason
    return scores
