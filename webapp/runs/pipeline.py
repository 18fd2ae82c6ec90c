"""The database side of the generate → verify → train loop: snapshots, admission, claims, results.

Celery tasks (``workers/tasks``) call these functions; the pure scheduler (``workers.pipeline.scheduler``)
decides. Every claim is a conditional UPDATE, so a redelivered task finds its work taken and does
nothing twice. The database is the source of truth: Redis holds only queued messages, and
``recover_stalled`` re-issues whatever a lost message left behind.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from webapp.catalog.models import BaseModel, Task
from webapp.runs.models import PolicyVersion, PromptGroup, Run, Trajectory, Verdict
from workers.pipeline.scheduler import DomainShare, Limits, PipelineState, Plan
from workers.pipeline.spec import RunSpec

G = PromptGroup.Status
RUNNING_STATES = (G.ADMITTED, G.GENERATING, G.VERIFYING)
ACCEPTED_STATES = (G.READY, G.TRAINING, G.TRAINED)


def resolve_model_path(base_model: BaseModel) -> Path:
    """A base model's directory: absolute, under ARTIFACTS_ROOT, or relative to the project."""
    path = Path(base_model.path)
    if path.is_absolute():
        return path
    for root in (Path(settings.ARTIFACTS_ROOT), Path(settings.BASE_DIR)):
        if (root / path).exists():
            return root / path
    return Path(settings.BASE_DIR) / path


def run_dir(run_id: int) -> Path:
    return Path(settings.ARTIFACTS_ROOT) / "runs" / str(run_id)


def version_dir(run_id: int, number: int) -> Path | None:
    return None if number == 0 else run_dir(run_id) / "versions" / f"v{number:05d}"


def limits_for(spec: RunSpec) -> Limits:
    p = spec.pipeline
    staleness = 0 if p.mode == "sync" else p.max_staleness
    return Limits(batch_groups=p.batch_prompts, max_staleness=staleness, rollout_batch=p.rollout_batch_prompts,
                  max_in_flight=max(p.rollout_batch_prompts, p.batch_prompts) * 2, max_steps=spec.max_steps)


def snapshot(run: Run) -> PipelineState:
    counts = dict(PromptGroup.objects.filter(run=run).values_list("status").annotate(n=Count("id")))
    per_domain = dict(
        PromptGroup.objects.filter(run=run).exclude(status=G.DROPPED).values_list("domain_id").annotate(n=Count("id"))
    )
    exhausted = set(run.state.get("exhausted", []))
    domains = [
        DomainShare(rd.domain_id, rd.weight, rd.priority, per_domain.get(rd.domain_id, 0), rd.domain_id in exhausted)
        for rd in run.run_domains.all()
    ]
    return PipelineState(
        version=run.latest_version, step=run.step,
        accepted=sum(counts.get(s, 0) for s in ACCEPTED_STATES),
        running=sum(counts.get(s, 0) for s in RUNNING_STATES),
        ready=counts.get(G.READY, 0),
        training=bool(run.state.get("train_claim")) or counts.get(G.TRAINING, 0) > 0,
        domains=domains,
    )


def _next_tasks(run: Run, domain_id: int, n: int) -> list[Task]:
    """The next ``n`` train tasks of a domain after the run's data cursor, wrapping around (epochs)."""
    cursor: dict[str, int] = run.state.setdefault("cursor", {})
    after = cursor.get(str(domain_id), 0)
    base = Task.objects.filter(domain_id=domain_id, split=Task.Split.TRAIN).order_by("id")
    tasks = list(base.filter(id__gt=after)[:n])
    if len(tasks) < n:
        tasks += list(base[: n - len(tasks)])  # next epoch
    if tasks:
        cursor[str(domain_id)] = tasks[-1].pk
    return tasks


def apply_admission(run: Run, plan: Plan) -> list[int]:
    """Create the admitted groups (under the caller's lock on the run) and return their ids."""
    groups = []
    exhausted = set(run.state.get("exhausted", []))
    for domain_id, n in plan.admit.items():
        tasks = _next_tasks(run, domain_id, n)
        if not tasks:
            exhausted.add(domain_id)
        for task in tasks:
            groups.append(PromptGroup(run=run, key=uuid.uuid4().hex, task=task, domain_id=domain_id,
                                      admitted_version=run.latest_version))
    run.state["exhausted"] = sorted(exhausted)
    PromptGroup.objects.bulk_create(groups)
    Run.objects.filter(pk=run.pk).update(state=run.state)
    return [g.pk for g in groups]


def claim_groups(group_ids: list[int], from_status: str, to_status: str) -> list[PromptGroup]:
    PromptGroup.objects.filter(pk__in=group_ids, status=from_status).update(status=to_status, updated_at=timezone.now())
    return list(PromptGroup.objects.filter(pk__in=group_ids, status=to_status).select_related("task", "domain"))


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


def write_samples(run_id: int, groups: dict[int, PromptGroup], rows: list[SampleRow]) -> None:
    """Write trajectories (idempotent on (run, group, index)) and move their groups to verifying."""
    with transaction.atomic():
        Trajectory.objects.bulk_create([
            Trajectory(run_id=run_id, task_id=groups[r.group_id].task_id, domain_id=groups[r.group_id].domain_id,
                       group_key=groups[r.group_id].key, sample_index=r.index, version=r.version, prompt=r.prompt,
                       completion=r.completion, prompt_token_ids=r.prompt_token_ids,
                       completion_token_ids=r.completion_token_ids, behaviour_logprobs=r.logprobs,
                       finish_reason=r.finish_reason)
            for r in rows
        ], ignore_conflicts=True)
        per_group: dict[int, int] = {}
        for r in rows:
            per_group[r.group_id] = per_group.get(r.group_id, 0) + 1
        version = rows[0].version if rows else 0
        for gid, n in per_group.items():
            PromptGroup.objects.filter(pk=gid, status=G.GENERATING).update(
                status=G.VERIFYING, n_samples=n, generated_version=version, updated_at=timezone.now())


def group_trajectories(group: PromptGroup) -> list[Trajectory]:
    return list(Trajectory.objects.filter(run_id=group.run_id, group_key=group.key).order_by("sample_index"))


def record_verdict(trajectory_id: int, *, status: str, score: float | None, reason: str, details: dict[str, Any],
                   latency_ms: float) -> bool:
    """Store one verdict unless one is already there (a redelivered verification does nothing)."""
    return bool(Trajectory.objects.filter(pk=trajectory_id, verdict=Verdict.PENDING).update(
        verdict=status, reward=score, verdict_reason=reason or "", verifier_details=details,
        verify_latency_ms=latency_ms))


def finish_verification(group: PromptGroup) -> bool:
    """Move a group to the ready buffer once every sample has a verdict."""
    pending = Trajectory.objects.filter(run_id=group.run_id, group_key=group.key, verdict=Verdict.PENDING).exists()
    if pending:
        return False
    return bool(PromptGroup.objects.filter(pk=group.pk, status=G.VERIFYING).update(status=G.READY,
                                                                                     updated_at=timezone.now()))


def claim_train_batch(run: Run, step: int, batch: int, max_staleness: int) -> list[PromptGroup]:
    """Claim B ready groups for train step ``step`` (or re-find them when this step is redelivered)."""
    with transaction.atomic():
        Run.objects.select_for_update().filter(pk=run.pk).first()
        claimed = list(PromptGroup.objects.filter(run=run, status=G.TRAINING, trained_step=step))
        if not claimed:
            oldest_allowed = run.latest_version - max_staleness
            stale = PromptGroup.objects.filter(run=run, status=G.READY, generated_version__lt=oldest_allowed)
            stale.update(status=G.DROPPED, drop_reason=f"staler than {max_staleness} version(s) at step {step}")
            ids = list(PromptGroup.objects.filter(run=run, status=G.READY).order_by("id")
                       .values_list("id", flat=True)[:batch])
            if len(ids) < batch:
                return []
            PromptGroup.objects.filter(pk__in=ids, status=G.READY).update(
                status=G.TRAINING, trained_step=step, updated_at=timezone.now())
            claimed = list(PromptGroup.objects.filter(pk__in=ids, status=G.TRAINING, trained_step=step))
    return claimed


def release_train_claim(run_id: int) -> None:
    """Forget a train claim that will not be carried out (nothing ready, or the run stopped)."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run_id)
        if "train_claim" in locked.state:
            state = {k: v for k, v in locked.state.items() if k != "train_claim"}
            Run.objects.filter(pk=run_id).update(state=state)


def finish_train_step(run: Run, step: int, groups: list[PromptGroup], *, version_path: Path, metrics: dict[str, Any],
                      finished_at: float) -> PolicyVersion:
    """Record version ``latest+1``, mark the groups trained and advance the run, in one transaction."""
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
        PromptGroup.objects.filter(pk__in=[g.pk for g in groups], status=G.TRAINING).update(
            status=G.TRAINED, updated_at=timezone.now())
        Trajectory.objects.filter(run=run, group_key__in=[g.key for g in groups]).update(trained_step=step)
        state = dict(locked.state)
        state.pop("train_claim", None)
        state["last_step_at"] = finished_at  # wall clock of the last step: the GPU-busy fraction's window
        Run.objects.filter(pk=run.pk).update(step=step, latest_version=number, state=state,
                                             updated_at=timezone.now())
    return version


def recover_stalled(run: Run, older_than: timedelta) -> dict[str, list[int]]:
    """Groups whose message was lost (a worker killed, Redis restarted): what must be re-issued.

    Generation and verification are re-queued (at most 3 attempts, then the group is dropped with the
    reason); a claimed train step is re-issued as is (claims are idempotent).
    """
    cutoff = timezone.now() - older_than
    stalled = PromptGroup.objects.filter(run=run, status__in=RUNNING_STATES, updated_at__lt=cutoff)
    out: dict[str, list[int]] = {"generate": [], "verify": [], "dropped": []}
    for group in stalled:
        if group.attempt >= 3:
            PromptGroup.objects.filter(pk=group.pk).update(
                status=G.DROPPED, drop_reason=f"stalled in {group.status} after {group.attempt} attempts")
            out["dropped"].append(group.pk)
            continue
        if group.status in (G.ADMITTED, G.GENERATING):
            PromptGroup.objects.filter(pk=group.pk).update(status=G.ADMITTED, attempt=group.attempt + 1,
                                                           updated_at=timezone.now())
            out["generate"].append(group.pk)
        else:
            PromptGroup.objects.filter(pk=group.pk).update(attempt=group.attempt + 1, updated_at=timezone.now())
            out["verify"].append(group.pk)
    return out


def in_flight(run: Run) -> int:
    return PromptGroup.objects.filter(run=run).filter(Q(status__in=RUNNING_STATES) | Q(status=G.TRAINING)).count()


def add_busy(run_id: int, seconds: float) -> None:
    """Accumulate engine/trainer busy time for the GPU-busy fraction (telemetry only: kept in Redis)."""
    try:
        import redis

        redis.Redis.from_url(settings.REDIS_URL).incrbyfloat(f"temper:run:{run_id}:busy", seconds)
    except Exception:  # telemetry must never fail the work
        pass


def take_busy(run_id: int) -> float:
    """Busy seconds accumulated since the last call (reset atomically)."""
    try:
        import redis

        value = redis.Redis.from_url(settings.REDIS_URL).getdel(f"temper:run:{run_id}:busy")
        return float(value or 0.0)
    except Exception:
        return 0.0
