"""Verify-queue tasks: judge a group's samples, and calibrate a verifier."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from workers.celery import app

log = logging.getLogger(__name__)


def remote_judge(verifier_row: Any) -> bool:
    """An ``llm_judge`` verifier with an HTTP endpoint: it waits on the network, so judging is I/O-bound."""
    return bool(verifier_row is not None and verifier_row.kind == "llm_judge" and (verifier_row.config or {}).get("endpoint"))


def judge(verifier_row: Any, prompt: str, completion: str, reference: Any, kind: str | None = None) -> Any:
    """One verdict; ``kind`` is the task's domain kind (its reference is read as that kind's). A verifier
    that crashes gives ``invalid`` with the reason, never a score of 0."""
    from workers.verifiers.base import JudgeInput, get_verifier, invalid

    if verifier_row is None:
        return invalid("the domain has no verifier")
    started = time.monotonic()
    try:
        return get_verifier(verifier_row.kind, verifier_row.config).judge(
            JudgeInput(prompt=prompt, completion=completion, reference=reference, kind=kind))
    except Exception as exc:
        return invalid(f"verifier crashed: {type(exc).__name__}: {exc}").with_latency(
            (time.monotonic() - started) * 1000)


@app.task(name="workers.tasks.verify.verify_batch", ignore_result=True)
def verify_batch(run_id: int, group_ids: list[int], attempts: list[int]) -> str:
    """Fan a rollout batch out: a ``verify_group`` message for each group but the first, judged here.

    The first group's message is this one (same task id), so revoking a run's queued work covers both.
    """
    from webapp.runs.pipeline import verify_task_id

    with app.producer_or_acquire() as producer:
        for gid, attempt in zip(group_ids[1:], attempts[1:], strict=True):
            verify_group.apply_async((gid,), producer=producer, task_id=verify_task_id(run_id, gid, attempt))
    return str(verify_group(group_ids[0]))


@app.task(name="workers.tasks.verify.verify_group", ignore_result=True)
def verify_group(group_id: int) -> str:
    """Judge every pending sample of a group; when all are judged, the group joins the ready buffer.

    The group's verdicts are written together once judged (a redelivered task judges only what is still
    missing). An invalid verdict is stored as invalid, never as a score: the trainer leaves it out, the
    group counts it, and its prompt is admitted again ahead of new ones (``pipeline.invalid_retries``).
    Timings go on the group (``verify_wait_s``, ``verify_s``); the train step reports them per domain, so
    verification sends no websocket message of its own.
    """
    from django.db import transaction
    from django.utils import timezone

    from webapp.runs import pipeline
    from webapp.runs.models import PromptGroup, Run, RunStatus, Trajectory, Verdict
    from workers.pipeline.spec import RunSpec
    from workers.tasks.control import advance_run
    from workers.tasks.health import this_worker

    group = PromptGroup.objects.select_related("domain__verifier", "task", "run").filter(pk=group_id).first()
    if group is None or group.status != PromptGroup.Status.VERIFYING:
        return "skipped"
    started, wait = time.monotonic(), (timezone.now() - group.updated_at).total_seconds()
    # held from now on by this worker: if it dies mid-judgment, the recovery tick hands the group out again
    PromptGroup.objects.filter(pk=group.pk, status=PromptGroup.Status.VERIFYING).update(
        holder=this_worker(), updated_at=timezone.now())
    reference = group.task.reference if group.task else {}
    verifier = group.domain.verifier if group.domain else None
    kind = group.domain.kind if group.domain else None
    pending = list(Trajectory.objects.filter(run_id=group.run_id, group_key=group.key, verdict=Verdict.PENDING)
                   .only("id", "prompt", "completion").order_by("sample_index"))
    if remote_judge(verifier) and len(pending) > 1:
        # a remote judge spends its time waiting on the network: ask it about every sample at once
        with ThreadPoolExecutor(max_workers=min(len(pending), 16)) as pool:
            results = list(pool.map(lambda t: judge(verifier, t.prompt, t.completion, reference, kind), pending))
    else:  # in-process and sandboxed verifiers: one at a time (some use signals, main thread only)
        results = [judge(verifier, t.prompt, t.completion, reference, kind) for t in pending]
    with transaction.atomic():
        for t, v in zip(pending, results, strict=True):
            pipeline.record_verdict(t.pk, status=v.status, score=v.score, reason=v.reason or "",
                                    details=v.to_dict().get("details", {}), latency_ms=v.latency_ms)
        PromptGroup.objects.filter(pk=group.pk, verify_s__isnull=True).update(
            verify_wait_s=wait, verify_s=time.monotonic() - started)
    spec = RunSpec.model_validate(group.run.spec)
    status = pipeline.finish_verification(group, spec.pipeline.invalid_retries)
    if status is None:
        return "pending"
    # Verification changes what the control worker would do only when a batch is ready to train, a group
    # was dropped (it frees admission room), or the run is pausing or ended: otherwise spare it a call.
    run_status, state = Run.objects.filter(pk=group.run_id).values_list("status", "state").get()
    ready = PromptGroup.objects.filter(run_id=group.run_id, status=PromptGroup.Status.READY).count()
    if (status == PromptGroup.Status.DROPPED or run_status != RunStatus.RUNNING
            or (ready >= spec.pipeline.batch_prompts and not state.get("train_claim"))):
        advance_run.delay(group.run_id)
    return status


@app.task(name="workers.tasks.verify.score_evaluation", ignore_result=True)
def score_evaluation(run_id: int, version: int, samples: int) -> dict[str, float]:
    """Held-out evaluation, the judging half: score the samples ``evaluate`` wrote, per domain.

    A task's score is its sample's reward (greedy), or 1 when any of its ``samples`` completions passes
    (pass@k). Invalid verdicts are left out and counted. Each domain's Evaluation gets the per-task scores
    (``results["tasks"]``, what version comparisons pair on); greedy scores become ``heldout_reward``
    points (pass@k ones ``heldout_pass_at_<k>``), and a greedy overall score at the run's target completes it.
    """
    import statistics
    from collections import defaultdict

    from django.db import transaction

    from webapp.runs import pipeline, services
    from webapp.runs.metrics import Point
    from webapp.runs.models import Evaluation, PolicyVersion, Run, RunStatus, Trajectory, Verdict
    from workers.pipeline.spec import RunSpec
    from workers.tasks.control import advance_run
    from workers.telemetry import emit

    run = Run.objects.filter(pk=run_id).first()
    version_row = PolicyVersion.objects.filter(run_id=run_id, number=version).first()
    if run is None or version_row is None:
        return {}
    spec = RunSpec.model_validate(run.spec)
    scores: dict[str, float] = {}
    weighted: list[tuple[float, float]] = []
    name = "heldout_reward" if samples == 1 else f"heldout_pass_at_{samples}"
    points = []
    prefix = pipeline.eval_key(version, samples, 0)[:-1]
    for rd in run.run_domains.select_related("domain__verifier"):
        rows = list(Trajectory.objects.filter(run=run, is_eval=True, domain=rd.domain, group_key__startswith=prefix)
                    .select_related("task").only("id", "prompt", "completion", "verdict", "reward", "task__reference"))
        if not rows:
            continue
        judged = [(t, judge(rd.domain.verifier, t.prompt, t.completion, t.task.reference if t.task else {},
                            rd.domain.kind))
                  for t in rows if t.verdict == Verdict.PENDING]
        with transaction.atomic():
            for t, v in judged:
                pipeline.record_verdict(t.pk, status=v.status, score=v.score, reason=v.reason or "",
                                        details=v.to_dict().get("details", {}), latency_ms=v.latency_ms)
                t.verdict, t.reward = v.status, v.score
        per_task: defaultdict[int, list[tuple[str, float | None]]] = defaultdict(list)
        for t in rows:
            per_task[t.task_id or 0].append((t.verdict, t.reward))
        results, passed, invalid = [], 0, 0
        for task_id, outcomes in per_task.items():
            valid = [(v, r) for v, r in outcomes if v != Verdict.INVALID]
            invalid += len(outcomes) - len(valid)
            if not valid:
                continue
            ok = any(v == Verdict.PASS for v, _ in valid)
            passed += ok
            results.append([task_id, float(ok) if samples > 1 else float(valid[0][1] or 0.0)])
        score = statistics.fmean(s for _, s in results) if results else 0.0
        Evaluation.objects.update_or_create(version=version_row, domain=rd.domain, suite="heldout", defaults={
            "status": Evaluation.Status.DONE, "n_tasks": len(per_task), "n_samples": samples, "score": score,
            "pass_rate": passed / max(1, len(results)), "invalid_count": invalid,
            "results": {"greedy": samples == 1, "samples": samples, "tasks": results}})
        scores[rd.domain.name] = score
        weighted.append((score, rd.weight))
        points.append(Point(name, version_row.step, score, domain_id=rd.domain_id))
    if not weighted:
        return scores
    overall = sum(s * w for s, w in weighted) / sum(w for _, w in weighted)
    scores["overall"] = overall
    points.append(Point(name, version_row.step, overall))
    emit(run_id, points)
    key = "heldout" if samples == 1 else f"heldout_pass_at_{samples}"
    PolicyVersion.objects.filter(pk=version_row.pk).update(metrics={**version_row.metrics, key: scores})
    if (samples == 1 and spec.target_reward is not None and version > 0 and overall >= spec.target_reward
            and run.status == RunStatus.RUNNING):
        services.do_complete_run(run, f"held-out reward {overall:.3f} reached the target {spec.target_reward}")
        advance_run.delay(run_id)  # drops what the completed run still had in flight, with the reason
    return scores


@app.task(name="workers.tasks.verify.calibrate_verifier")
def calibrate_verifier(report_id: int) -> str:
    """Run the calibration of a pending report. Idempotent: a report already claimed is left alone."""
    from webapp.catalog.models import CalibrationReport
    from webapp.catalog.services import do_run_calibration

    claimed = CalibrationReport.objects.filter(
        pk=report_id, status=CalibrationReport.Status.PENDING
    ).update(status=CalibrationReport.Status.RUNNING)
    if not claimed:
        return "already claimed"
    report = do_run_calibration(CalibrationReport.objects.select_related("verifier").get(pk=report_id))
    return "error" if report.error else ("passed" if report.passed else "failed")
