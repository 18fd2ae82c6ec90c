"""The books of a run: every admitted prompt group trained exactly once or dropped with a reason.

What the fault tests (a worker killed mid-step, Redis restarted, ``make run`` stopped and started again)
check after the fact, and what a person can check on any run (``accounting(run).problems``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.db.models import Count

from webapp.catalog.models import TaskDomain
from webapp.runs.models import PromptGroup, Run, Trajectory
from workers.pipeline.spec import RunSpec

G = PromptGroup.Status
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Accounting:
    """Where every admitted prompt group of a run ended up; ``problems`` is empty when the counts add up."""

    admitted: int
    by_status: dict[str, int]
    trained_samples: int
    steps: int
    problems: list[str]


def domain_key(domain_id: int | None) -> str:
    """A domain's key in ``Run.trained_groups``: its id, "" for groups without a domain."""
    return "" if domain_id is None else str(domain_id)


def count_trained(run: Run) -> dict[str, int]:
    """The run's trained groups by domain (``domain_key``), counted from the group table: what
    ``Run.trained_groups`` keeps. Reads the whole run: for a check, a start or a resume, not a tick."""
    return {domain_key(domain_id): n for domain_id, n in (
        PromptGroup.objects.filter(run=run, status=G.TRAINED).values_list("domain_id").annotate(n=Count("id"))
        .order_by())}


def kept_count(run: Run) -> dict[str, int]:
    """``Run.trained_groups`` as read now, a domain deleted since (its groups' domain set to NULL) under ""."""
    kept: dict[str, int] = Run.objects.filter(pk=run.pk).values_list("trained_groups", flat=True).get()
    existing = set(TaskDomain.objects.filter(pk__in=[int(k) for k in kept if k]).values_list("pk", flat=True))
    out: dict[str, int] = {}
    for key, n in kept.items():
        key = key if key and int(key) in existing else ""
        if n:
            out[key] = out.get(key, 0) + n
    return out


def recount_trained(run: Run) -> None:
    """Set the run's kept count to the group table's when they differ (with a warning): a start or a resume
    begins from the groups themselves, whatever wrote the run row meanwhile (an old worker during an upgrade,
    a hand edit)."""
    counted = count_trained(run)
    if kept_count(run) != counted:
        log.warning("run %s: its trained count %s differed from its groups' %s; recounted", run.pk,
                    run.trained_groups, counted)
    if run.trained_groups != counted:
        Run.objects.filter(pk=run.pk).update(trained_groups=counted)
        run.trained_groups = counted


def accounting(run: Run) -> Accounting:
    """Check that every admitted group was trained exactly once or dropped with a reason.

    Trained groups: exactly ``n_samples`` samples, each marked with the group's train step, and exactly
    ``batch_prompts`` groups per step for steps 1..run.step, as many by domain as the run's own count
    (``Run.trained_groups``, what its ticks read). Dropped groups: a reason. Groups still in
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
    counted, kept = count_trained(run), kept_count(run)
    if kept != counted:
        problems.append(f"the run's trained groups by domain, {kept}, differ from the groups marked trained, {counted}")
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
