"""The database side of the generate → verify → train loop: snapshots, admission, claims, results.

Celery tasks (``workers/tasks``) call these functions; the pure scheduler (``workers.pipeline.scheduler``)
decides. Every claim is a conditional UPDATE, so a redelivered task finds its work taken and does
nothing twice. The database is the source of truth: Redis holds only queued messages, and
``recover_stalled`` re-issues whatever a lost message left behind.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from webapp.catalog.models import BaseModel, Task
from webapp.runs.models import PolicyVersion, PromptGroup, Run, Trajectory, Verdict, WorkerHeartbeat
from workers.pipeline.scheduler import DomainShare, Limits, PipelineState, Plan
from workers.pipeline.spec import RunSpec

G = PromptGroup.Status
TRAIN_CLAIM_KEYS = ("train_claim", "train_claim_at", "train_holder", "train_held_at")
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
    # In flight (admitted, not yet verified): two batches, or every batch the staleness bound lets ahead
    in_flight = max(max(p.rollout_batch_prompts, p.batch_prompts) * 2, (staleness + 1) * p.batch_prompts)
    return Limits(batch_groups=p.batch_prompts, max_staleness=staleness, rollout_batch=p.rollout_batch_prompts,
                  max_in_flight=in_flight, max_steps=spec.max_steps, admit_ahead=p.mode == "async")


def snapshot(run: Run) -> PipelineState:
    counts = dict(PromptGroup.objects.filter(run=run).values_list("status").annotate(n=Count("id")))
    per_domain = dict(
        PromptGroup.objects.filter(run=run).exclude(status=G.DROPPED).values_list("domain_id").annotate(n=Count("id"))
    )
    retries = dict(
        PromptGroup.objects.filter(run=run, retry_pending=True).values_list("domain_id").annotate(n=Count("id"))
    )
    exhausted = set(run.state.get("exhausted", []))
    domains = [
        DomainShare(rd.domain_id, rd.weight, rd.priority, per_domain.get(rd.domain_id, 0), rd.domain_id in exhausted,
                    retries.get(rd.domain_id, 0))
        for rd in run.run_domains.all()
    ]
    return PipelineState(
        version=run.latest_version, step=run.step,
        accepted=sum(counts.get(s, 0) for s in ACCEPTED_STATES),
        running=sum(counts.get(s, 0) for s in RUNNING_STATES),
        ready=counts.get(G.READY, 0),
        training=bool(run.state.get("train_claim")) or counts.get(G.TRAINING, 0) > 0,
        domains=domains,
        waiting=counts.get(G.ADMITTED, 0) + counts.get(G.GENERATING, 0),
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
    """Create the admitted groups (under the caller's lock on the run) and return their ids.

    Retries first: each one is a new group for the prompt of an earlier group that got an invalid verdict.
    """
    groups = []
    for domain_id, n in plan.retry.items():
        earlier = list(PromptGroup.objects.filter(run=run, retry_pending=True, domain_id=domain_id).order_by("id")[:n])
        PromptGroup.objects.filter(pk__in=[g.pk for g in earlier]).update(retry_pending=False)
        groups += [PromptGroup(run=run, key=uuid.uuid4().hex, task_id=g.task_id, domain_id=domain_id,
                               admitted_version=run.latest_version, retries=g.retries + 1, retry_of=g)
                   for g in earlier]
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


def claim_groups(group_ids: list[int], from_status: str, to_status: str, holder: str = "") -> list[PromptGroup]:
    PromptGroup.objects.filter(pk__in=group_ids, status=from_status).update(status=to_status, holder=holder,
                                                                          updated_at=timezone.now())
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
                updated_at=timezone.now())


def group_trajectories(group: PromptGroup) -> list[Trajectory]:
    return list(Trajectory.objects.filter(run_id=group.run_id, group_key=group.key).order_by("sample_index"))


def batch_trajectories(run_id: int, groups: list[PromptGroup], *fields: str) -> dict[str, list[Trajectory]]:
    """The samples of several groups in one query, by group key, in sample order."""
    qs = Trajectory.objects.filter(run_id=run_id, group_key__in=[g.key for g in groups])
    if fields:
        qs = qs.only("group_key", "sample_index", *fields)
    out: dict[str, list[Trajectory]] = {g.key: [] for g in groups}
    for t in qs.order_by("group_key", "sample_index"):
        out[t.group_key].append(t)
    return out


def record_verdict(trajectory_id: int, *, status: str, score: float | None, reason: str, details: dict[str, Any],
                   latency_ms: float) -> bool:
    """Store one verdict unless one is already there (a redelivered verification does nothing)."""
    return bool(Trajectory.objects.filter(pk=trajectory_id, verdict=Verdict.PENDING).update(
        verdict=status, reward=score, verdict_reason=reason or "", verifier_details=details,
        verify_latency_ms=latency_ms))


def finish_verification(group: PromptGroup, max_retries: int) -> str | None:
    """Once every sample has a verdict: the group joins the ready buffer, or is dropped when no verdict is usable.

    Invalid verdicts are counted on the group and never scored: the trainer leaves them out. A group with
    any invalid verdict queues its prompt for another admission (ahead of new prompts) unless it already
    had ``max_retries``. Returns the group's new status, or None while verdicts are missing (or when
    another delivery finished it first).
    """
    verdicts = list(Trajectory.objects.filter(run_id=group.run_id, group_key=group.key)
                    .values_list("verdict", "verdict_reason"))
    if not verdicts or any(v == Verdict.PENDING for v, _ in verdicts):
        return None
    invalid = [reason for v, reason in verdicts if v == Verdict.INVALID]
    retry = bool(invalid) and group.retries < max_retries
    fields: dict[str, Any] = {"invalid": len(invalid), "retry_pending": retry, "updated_at": timezone.now()}
    if len(invalid) == len(verdicts):
        status = G.DROPPED
        fields["drop_reason"] = (f"every verdict invalid ({invalid[0][:80]})"
                                 + ("; prompt queued again" if retry else f"; no retry left after {group.retries}"))[:200]
    else:
        status = G.READY
    changed = PromptGroup.objects.filter(pk=group.pk, status=G.VERIFYING).update(status=status, **fields)
    return status if changed else None


def drop_stale(run: Run, max_staleness: int, step: int) -> int:
    """Drop ready groups generated more than ``max_staleness`` versions before the newest (too off-policy)."""
    return PromptGroup.objects.filter(run=run, status=G.READY,
                                      generated_version__lt=run.latest_version - max_staleness).update(
        status=G.DROPPED, drop_reason=f"staler than {max_staleness} version(s) at step {step}",
        retry_pending=False, updated_at=timezone.now())


def claim_train_batch(run: Run, step: int, batch: int, max_staleness: int, holder: str = "") -> list[PromptGroup]:
    """Claim B ready groups for train step ``step`` (or re-find them when this step is redelivered).

    ``holder`` (the worker taking the step) is recorded on the run, so a worker known gone mid-step has its
    step re-sent at once (``train_claim_orphaned``)."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().filter(pk=run.pk).first()
        if locked is not None and holder and locked.state.get("train_claim") == step:
            Run.objects.filter(pk=run.pk).update(state={**locked.state, "train_holder": holder,
                                                        "train_held_at": time.time()})
        claimed = list(PromptGroup.objects.filter(run=run, status=G.TRAINING, trained_step=step))
        if not claimed:
            drop_stale(run, max_staleness, step)
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
            state = {k: v for k, v in locked.state.items() if k not in TRAIN_CLAIM_KEYS}
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
        for key in TRAIN_CLAIM_KEYS:
            state.pop(key, None)
        state.pop("failures", None)  # the loop made progress: earlier task failures were transient
        # wall clock of the last two steps: the GPU-busy fraction's window
        state["step_window"] = [state.get("last_step_at") or finished_at, finished_at]
        state["last_step_at"] = finished_at
        Run.objects.filter(pk=run.pk).update(step=step, latest_version=number, state=state,
                                             updated_at=timezone.now())
    return version


def release_generation(group_ids: list[int]) -> int | None:
    """Groups a failed generation task held go back to admitted (attempt + 1), to be generated again;
    the first group's new attempt (part of the new task's id), or None when none was still held."""
    with transaction.atomic():
        held = list(PromptGroup.objects.select_for_update().filter(pk__in=group_ids, status=G.GENERATING)
                    .order_by("id").values_list("id", "attempt"))
        if not held:
            return None
        PromptGroup.objects.filter(pk__in=[g for g, _ in held]).update(
            status=G.ADMITTED, attempt=held[0][1] + 1, updated_at=timezone.now())
    return held[0][1] + 1


@dataclass(frozen=True)
class WorkerLiveness:
    """The workers' heartbeats at one moment: which holder is known gone since when it took its work."""

    rows: dict[str, tuple[Any, Any, Any]]
    """node name -> (started_at, last_seen, stopped_at)"""
    silent_after: timedelta

    @classmethod
    def now(cls, silent_after: timedelta) -> WorkerLiveness:
        return cls({name: (started, seen, stopped) for name, started, seen, stopped in WorkerHeartbeat.objects
                    .values_list("name", "started_at", "last_seen", "stopped_at")}, silent_after)

    def gone(self, holder: str, since: Any) -> str | None:
        """Why ``holder``, which took its work at ``since``, is known gone (None while it may still work)."""
        if not holder:
            return None
        row = self.rows.get(holder)
        if row is None:
            return f"{holder} has no heartbeat"
        started, seen, stopped = row
        if stopped is not None and stopped >= since:
            return f"{holder} stopped"
        if started > since:
            return f"{holder} restarted"
        if seen < timezone.now() - self.silent_after:
            return f"{holder} went silent"
        return None


def recover_stalled(run: Run, older_than: timedelta, *, liveness: WorkerLiveness | None = None,
                    everything: bool = False) -> dict[str, Any]:
    """Groups whose message was lost (a worker killed, Redis restarted): what must be re-issued.

    Stalled: no progress for ``older_than``; or held by a worker ``liveness`` knows is gone (its process
    stopped, restarted or went silent: its work is handed out again at once, not after the timeout); or,
    with ``everything``, all work in flight (the broker lost every queued message). Generation and
    verification are re-queued (at most 3 attempts, then the group is dropped with the reason); a claimed
    train step is re-issued as is (claims are idempotent). ``attempts`` maps each re-issued group to its new
    attempt number (part of its task id); ``why`` counts the reasons.
    """
    cutoff = timezone.now() - older_than
    candidates = PromptGroup.objects.filter(run=run, status__in=RUNNING_STATES)
    if not everything and liveness is None:
        candidates = candidates.filter(updated_at__lt=cutoff)
    out: dict[str, Any] = {"generate": [], "verify": [], "dropped": [], "attempts": {}, "why": {}}
    for group in candidates:
        if everything:
            why = "the broker lost its queued messages"
        elif group.updated_at < cutoff:
            why = f"no progress for {older_than.total_seconds():.0f} s"
        elif liveness is not None and (gone := liveness.gone(group.holder, group.updated_at)):
            why = gone
        else:
            continue
        out["why"][why] = out["why"].get(why, 0) + 1
        if group.attempt >= 3:
            PromptGroup.objects.filter(pk=group.pk).update(
                status=G.DROPPED, drop_reason=f"stalled in {group.status} after {group.attempt} attempts ({why})"[:200])
            out["dropped"].append(group.pk)
            continue
        if group.status in (G.ADMITTED, G.GENERATING):
            PromptGroup.objects.filter(pk=group.pk).update(status=G.ADMITTED, attempt=group.attempt + 1, holder="",
                                                           updated_at=timezone.now())
            out["generate"].append(group.pk)
        else:
            PromptGroup.objects.filter(pk=group.pk).update(attempt=group.attempt + 1, holder="",
                                                           updated_at=timezone.now())
            out["verify"].append(group.pk)
        out["attempts"][group.pk] = group.attempt + 1
    return out


def train_claim_orphaned(run: Run, older_than: timedelta, *, liveness: WorkerLiveness | None = None,
                         everything: bool = False) -> str | None:
    """Why the run's claimed train step must be sent again (None when it is fine or there is none)."""
    if not run.state.get("train_claim"):
        return None
    if everything:
        return "the broker lost its queued messages"
    if run.updated_at < timezone.now() - older_than:
        return f"no progress for {older_than.total_seconds():.0f} s"
    holder, since = run.state.get("train_holder"), run.state.get("train_held_at")
    if liveness is not None and holder and since:
        return liveness.gone(holder, datetime.fromtimestamp(float(since), tz=UTC))
    return None


# Celery task ids are derived from the work they carry, so cancelling a run can revoke its queued tasks
# without keeping a list of them: the database says which groups and which train step are pending.
def generate_task_id(run_id: int, first_group_id: int, attempt: int) -> str:
    return f"generate-r{run_id}-g{first_group_id}-a{attempt}"


def verify_task_id(run_id: int, group_id: int, attempt: int) -> str:
    return f"verify-r{run_id}-g{group_id}-a{attempt}"


def eval_key(version: int, samples: int, task_id: int) -> str:
    """The group key of a held-out task's evaluation samples (``Trajectory.is_eval``)."""
    return f"eval-v{version}-k{samples}-t{task_id}"


def train_task_id(run_id: int, step: int) -> str:
    return f"train-r{run_id}-s{step}"


def queued_task_ids(run: Run) -> list[str]:
    """Ids of every task that may still be queued for the run's unfinished work (for revocation)."""
    ids = []
    for gid, status, attempt in PromptGroup.objects.filter(run=run, status__in=RUNNING_STATES).values_list(
            "id", "status", "attempt"):
        ids.append(verify_task_id(run.pk, gid, attempt) if status == G.VERIFYING
                   else generate_task_id(run.pk, gid, attempt))
    if claim := run.state.get("train_claim"):
        ids.append(train_task_id(run.pk, int(claim)))
    return ids


def drop_unfinished(run: Run, reason: str) -> int:
    """Drop every group of an ended run that was neither trained nor dropped, with the reason."""
    return PromptGroup.objects.filter(run=run).exclude(status__in=[G.TRAINED, G.DROPPED]).update(
        status=G.DROPPED, drop_reason=reason[:200], retry_pending=False, updated_at=timezone.now())


@dataclass(frozen=True)
class Accounting:
    """Where every admitted prompt group of a run ended up; ``problems`` is empty when the counts add up."""

    admitted: int
    by_status: dict[str, int]
    trained_samples: int
    steps: int
    problems: list[str]


def accounting(run: Run) -> Accounting:
    """Check that every admitted group was trained exactly once or dropped with a reason.

    Trained groups: exactly ``n_samples`` samples, each marked with the group's train step, and exactly
    ``batch_prompts`` groups per step for steps 1..run.step. Dropped groups: a reason. Groups still in
    flight are reported by status (a finished run has none).
    """
    spec = RunSpec.model_validate(run.spec)
    groups = PromptGroup.objects.filter(run=run)
    by_status = dict(groups.values_list("status").annotate(n=Count("id")))
    problems: list[str] = []
    if n := groups.filter(status=G.DROPPED, drop_reason="").count():
        problems.append(f"{n} dropped group(s) without a reason")
    per_step = dict(groups.filter(status=G.TRAINED).values_list("trained_step").annotate(n=Count("id")))
    expected_steps = set(range(1, run.step + 1))
    if set(per_step) != expected_steps:
        problems.append(f"trained steps {sorted(per_step)} differ from 1..{run.step}")
    if wrong := {s: n for s, n in per_step.items() if n != spec.pipeline.batch_prompts}:
        problems.append(f"steps with a group count other than {spec.pipeline.batch_prompts}: {wrong}")
    trained = groups.filter(status=G.TRAINED)
    samples = Trajectory.objects.filter(run=run, group_key__in=trained.values("key"))
    sample_steps = dict(samples.values_list("group_key").annotate(n=Count("id")))
    expected = dict(trained.values_list("key", "n_samples"))
    if short := [k for k, n in expected.items() if sample_steps.get(k, 0) != n]:
        problems.append(f"{len(short)} trained group(s) whose sample count differs from n_samples")
    step_of = dict(trained.values_list("key", "trained_step"))
    marked = samples.values_list("group_key", "trained_step").distinct()
    if bad := [k for k, s in marked if s != step_of.get(k)]:
        problems.append(f"{len(bad)} trained group(s) with samples marked for another step (or none)")
    trained_elsewhere = Trajectory.objects.filter(run=run, trained_step__isnull=False).exclude(
        group_key__in=trained.values("key")).count()
    if trained_elsewhere:
        problems.append(f"{trained_elsewhere} sample(s) marked trained outside a trained group")
    return Accounting(admitted=sum(by_status.values()), by_status=by_status,
                      trained_samples=samples.count(), steps=run.step, problems=problems)


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
