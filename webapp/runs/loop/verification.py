"""Verification (the verify workers): judge every pending sample of a group, store the verdicts together,
and move the group to the ready buffer — or drop it when no verdict is usable.

A verdict is three-valued: a score in [0, 1], or invalid with the reason. Invalid verdicts are stored
without a score, counted on the group and left out of the loss; a group with any is queued for another
admission ahead of new prompts (``pipeline.invalid_retries``). A redelivered judgment writes nothing twice
(``record_verdict`` only fills a pending verdict).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.db import transaction
from django.utils import timezone

from webapp.runs.models import PromptGroup, Run, RunStatus, Trajectory, VerdictChoice
from workers import messages
from workers.pipeline.spec import RunSpec

G = PromptGroup.Status


def remote_judge(verifier_row: Any) -> bool:
    """An ``llm_judge`` verifier with an HTTP endpoint: it waits on the network, so judging is I/O-bound."""
    return bool(verifier_row is not None and verifier_row.kind == "llm_judge"
                and (verifier_row.config or {}).get("endpoint"))


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


def judge_group(verifier_row: Any, samples: list[tuple[str, str]], reference: Any, kind: str | None = None) -> list[Any]:
    """The verdicts of one group's (prompt, completion) samples, which share the task's reference: judged
    together where the kind can (``python_reward``: one sandbox execution for the group), else one by one."""
    from workers.verifiers.base import JudgeInput, get_verifier, invalid

    if verifier_row is None:
        return [invalid("the domain has no verifier")] * len(samples)
    started = time.monotonic()
    try:
        return get_verifier(verifier_row.kind, verifier_row.config).judge_group(
            [JudgeInput(prompt=p, completion=c, reference=reference, kind=kind) for p, c in samples])
    except Exception as exc:
        latency = (time.monotonic() - started) * 1000 / max(1, len(samples))
        return [invalid(f"verifier crashed: {type(exc).__name__}: {exc}").with_latency(latency)] * len(samples)


def score_episode(domain: Any, verifier_row: Any, trajectory: Trajectory, task: Any) -> Any:
    """A multi-turn episode's verdict: its environment scores the stored transcript (its task and turns),
    from what the environment holds — the domain's verifier on the final answer, or its own rule."""
    from workers.environments.base import EnvTask, Transcript, Turn, make_environment
    from workers.verifiers.base import invalid

    started = time.monotonic()
    reference = task.reference if task is not None else {}
    env_task = EnvTask(prompt=trajectory.prompt, reference=reference,
                       metadata=task.metadata if task is not None else {}, kind=domain.kind)
    try:
        env = make_environment(domain.environment, domain.environment_params,
                               judge=lambda t, text: judge(verifier_row, t.prompt, text, t.reference, t.kind))
        transcript = Transcript(env_task, [Turn.from_dict(d) for d in trajectory.turns],
                                trajectory.stop_reason or "done")  # type: ignore[arg-type]
        verdict = env.score(transcript)
    except Exception as exc:
        return invalid(f"the environment could not score the episode: {type(exc).__name__}: {exc}"[:500])
    return verdict.with_latency((time.monotonic() - started) * 1000)


def record_verdict(trajectory_id: int, *, status: str, score: float | None, reason: str, details: dict[str, Any],
                   latency_ms: float) -> bool:
    """Store one verdict unless one is already there (a redelivered verification does nothing)."""
    return bool(Trajectory.objects.filter(pk=trajectory_id, verdict=VerdictChoice.PENDING).update(
        verdict=status, reward=score, verdict_reason=reason or "", verifier_details=details,
        verify_latency_ms=latency_ms))


def finish(group: PromptGroup, max_retries: int) -> str | None:
    """Once every sample has a verdict: the group joins the ready buffer, or is dropped when no verdict is
    usable. Returns the group's new status, or None while verdicts are missing (or when another delivery
    finished it first)."""
    verdicts = list(Trajectory.objects.filter(run_id=group.run_id, group_key=group.key)
                    .values_list("verdict", "verdict_reason"))
    if not verdicts or any(v == VerdictChoice.PENDING for v, _ in verdicts):
        return None
    invalid = [reason for v, reason in verdicts if v == VerdictChoice.INVALID]
    retry = bool(invalid) and group.retries < max_retries
    fields: dict[str, Any] = {"invalid": len(invalid), "retry_pending": retry, "holder": "",
                              "updated_at": timezone.now()}
    if len(invalid) == len(verdicts):
        status = G.DROPPED
        fields["drop_reason"] = (f"every verdict invalid ({invalid[0][:80]})"
                                 + ("; prompt queued again" if retry else f"; no retry left after {group.retries}"))[:200]
    else:
        status = G.READY
    changed = PromptGroup.objects.filter(pk=group.pk, status=G.VERIFYING).update(status=status, **fields)
    return status if changed else None


def verify_group(group_id: int, holder: str) -> str:
    """Judge every pending sample of a group; when all are judged, the group joins the ready buffer.

    Timings go on the group (``verify_wait_s``, ``verify_s``); the train step reports them per domain, so
    verification sends no websocket message of its own.
    """
    group = PromptGroup.objects.select_related("domain__verifier", "task", "run").filter(pk=group_id).first()
    if group is None or group.status != G.VERIFYING:
        return "skipped"
    started, wait = time.monotonic(), (timezone.now() - group.updated_at).total_seconds()
    # held from now on by this worker: if it dies mid-judgment, the recovery tick hands the group out again
    PromptGroup.objects.filter(pk=group.pk, status=G.VERIFYING).update(holder=holder, updated_at=timezone.now())
    reference = group.task.reference if group.task else {}
    verifier = group.domain.verifier if group.domain else None
    kind = group.domain.kind if group.domain else None
    pending = list(Trajectory.objects.filter(run_id=group.run_id, group_key=group.key, verdict=VerdictChoice.PENDING)
                   .only("id", "prompt", "completion", "turns", "stop_reason").order_by("sample_index"))
    if group.domain is not None and group.domain.environment != "single_turn":
        results = [score_episode(group.domain, verifier, t, group.task) for t in pending]
    elif remote_judge(verifier) and len(pending) > 1:
        # a remote judge spends its time waiting on the network: ask it about every sample at once
        with ThreadPoolExecutor(max_workers=min(len(pending), 16)) as pool:
            results = list(pool.map(lambda t: judge(verifier, t.prompt, t.completion, reference, kind), pending))
    else:  # in-process and sandboxed verifiers in this thread (some use signals, main thread only)
        results = judge_group(verifier, [(t.prompt, t.completion) for t in pending], reference, kind)
    with transaction.atomic():
        for t, v in zip(pending, results, strict=True):
            record_verdict(t.pk, status=v.status, score=v.score, reason=v.reason or "",
                           details=v.to_dict().get("details", {}), latency_ms=v.latency_ms)
        PromptGroup.objects.filter(pk=group.pk, verify_s__isnull=True).update(
            verify_wait_s=wait, verify_s=time.monotonic() - started)
    spec = RunSpec.model_validate(group.run.spec)
    status = finish(group, spec.pipeline.invalid_retries)
    if status is None:
        return "pending"
    # Verification changes what the control worker would do only when a batch is ready to train, a group
    # was dropped (it frees admission room), or the run is pausing or ended: otherwise spare it a call.
    run_status, state = Run.objects.filter(pk=group.run_id).values_list("status", "state").get()
    ready = PromptGroup.objects.filter(run_id=group.run_id, status=G.READY).count()
    if (status == G.DROPPED or run_status != RunStatus.RUNNING
            or (ready >= spec.pipeline.batch_prompts and not state.get("train_claim"))):
        messages.advance_run(group.run_id)
    return status
