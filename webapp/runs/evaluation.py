"""Comparing policy versions per domain, with confidence intervals, and the promotion gate.

An evaluation stores, per (version, domain, suite), the score of every held-out task
(``Evaluation.results["tasks"] = [[task_id, score], ...]``). Two versions evaluated on the same tasks
are compared *paired*: the mean of per-task differences with a normal 95% interval from their standard
error. That is far tighter than comparing two pass rates, so a real drop in one domain is seen even when
the other domain's gain lifts the average. A domain is flagged as a **regression** when the whole
interval lies below zero (the drop is beyond noise).

The gate (``check_gate``) compares a candidate with the version the alias points at now (or, with
nothing there yet, with the base model, version 0 of the candidate's run) and refuses promotion, with
reasons, when a domain regresses or the average gain is below the configured minimum.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from django.db.models import QuerySet
from pydantic import BaseModel as PydanticModel
from pydantic import ConfigDict, Field, ValidationError

from webapp.common.errors import ValidationFailed
from webapp.runs.models import Alias, Evaluation, PolicyVersion
from workers import messages

Z95 = 1.959964


class GateConfig(PydanticModel):
    """What promotion to a gated alias requires; stored per base model (``BaseModel.promotion_gate``)."""

    model_config = ConfigDict(extra="forbid")

    aliases: list[str] = Field(default=["production", "canary"], description="Aliases whose moves are gated")
    require_no_regression: bool = Field(True, description="Refuse when any domain drops beyond noise")
    min_gain: float = Field(0.0, ge=-1.0, le=1.0, description="Least gain of the average score over the baseline")
    suite: str = Field("heldout", description="The evaluation suite the gate reads")


def gate_config(raw: dict[str, Any] | None) -> GateConfig:
    try:
        return GateConfig.model_validate(raw or {})
    except ValidationError as exc:
        raise ValidationFailed("the promotion gate is invalid",
                               details={".".join(map(str, e["loc"])) or "gate": [e["msg"]] for e in exc.errors()}
                               ) from None


@dataclass
class DomainComparison:
    domain_id: int
    domain: str
    score: float | None
    baseline: float | None
    layer: str = "capability"
    """``capability`` (a single-turn domain's held-out items) or ``end_to_end`` (an environment domain's
    held-out tasks, played as whole episodes in sandbox sessions)."""
    delta: float | None = None
    ci95: tuple[float, float] | None = None
    paired_tasks: int = 0
    regression: bool = False
    improvement: bool = False
    note: str = ""


@dataclass
class Comparison:
    version: int
    baseline: int | None
    suite: str
    domains: list[DomainComparison] = field(default_factory=list)
    average: float | None = None
    baseline_average: float | None = None

    @property
    def regressions(self) -> list[DomainComparison]:
        return [d for d in self.domains if d.regression]

    def layers(self) -> dict[str, dict[str, Any]]:
        """Each evaluation layer on its own: its domains' average on both sides and its regressions, so one
        layer's gain never hides the other's loss."""
        out: dict[str, dict[str, Any]] = {}
        for layer in LAYERS:
            rows = [d for d in self.domains if d.layer == layer]
            if not rows:
                continue
            scored = [d for d in rows if d.score is not None and d.baseline is not None]
            average = statistics.fmean(d.score for d in scored) if scored else None  # type: ignore[misc]
            baseline = statistics.fmean(d.baseline for d in scored) if scored else None  # type: ignore[misc]
            out[layer] = {"domains": [d.domain for d in rows], "average": average, "baseline_average": baseline,
                          "gain": None if average is None or baseline is None else average - baseline,
                          "regressions": [d.domain for d in rows if d.regression]}
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "baseline": self.baseline, "suite": self.suite,
                "average": self.average, "baseline_average": self.baseline_average,
                "gain": None if self.average is None or self.baseline_average is None
                else self.average - self.baseline_average,
                "regressions": [d.domain for d in self.regressions], "layers": self.layers(),
                "domains": [asdict(d) for d in self.domains]}


def task_scores(evaluation: Evaluation) -> dict[str, float]:
    return {str(task): float(score) for task, score in (evaluation.results or {}).get("tasks", [])}


def paired_difference(a: dict[str, float], b: dict[str, float]) -> tuple[float, tuple[float, float], int] | None:
    """Mean of a - b over the tasks both hold, with its normal 95% interval; None without common tasks."""
    common = sorted(set(a) & set(b))
    if not common:
        return None
    diffs = [a[t] - b[t] for t in common]
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, (-math.inf, math.inf), len(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    if se == 0:  # every task moved the same way (or none moved): no noise to speak of
        return mean, (mean, mean), len(diffs)
    return mean, (mean - Z95 * se, mean + Z95 * se), len(diffs)


def unpaired_difference(a: Evaluation, b: Evaluation) -> tuple[float, tuple[float, float]] | None:
    if a.score is None or b.score is None or not a.n_tasks or not b.n_tasks:
        return None
    pa, pb = a.score, b.score
    se = math.sqrt(max(pa * (1 - pa), 1e-9) / a.n_tasks + max(pb * (1 - pb), 1e-9) / b.n_tasks)
    delta = pa - pb
    return delta, (delta - Z95 * se, delta + Z95 * se)


def latest_evaluations(version: PolicyVersion, suite: str) -> dict[int, Evaluation]:
    rows = Evaluation.objects.filter(version=version, suite=suite, status=Evaluation.Status.DONE)
    return {e.domain_id: e for e in rows.select_related("domain").order_by("id")}


def compare(version: PolicyVersion, baseline: PolicyVersion | None, suite: str = "heldout") -> Comparison:
    """Per-domain scores of ``version`` against ``baseline`` (paired on common tasks where possible)."""
    mine = latest_evaluations(version, suite)
    theirs = latest_evaluations(baseline, suite) if baseline is not None else {}
    result = Comparison(version=version.number, baseline=baseline.number if baseline else None, suite=suite)
    for domain_id in sorted(set(mine) | set(theirs)):
        a, b = mine.get(domain_id), theirs.get(domain_id)
        name = (a or b).domain.name  # type: ignore[union-attr]
        row = DomainComparison(domain_id=domain_id, domain=name, score=a.score if a else None,
                               baseline=b.score if b else None, layer=layer_of((a or b).domain))  # type: ignore[union-attr]
        if a is None or b is None:
            row.note = "not evaluated" if a is None else "baseline not evaluated"
        else:
            paired = paired_difference(task_scores(a), task_scores(b))
            if paired is not None:
                row.delta, row.ci95, row.paired_tasks = paired
            elif (unpaired := unpaired_difference(a, b)) is not None:
                row.delta, row.ci95 = unpaired
                row.note = "unpaired (no common tasks)"
            if row.ci95 is not None:
                row.regression = row.ci95[1] < 0
                row.improvement = row.ci95[0] > 0
        result.domains.append(row)
    scored = [d for d in result.domains if d.score is not None and d.baseline is not None]
    if scored:
        result.average = statistics.fmean(d.score for d in scored)  # type: ignore[misc]
        result.baseline_average = statistics.fmean(d.baseline for d in scored)  # type: ignore[misc]
    return result


LAYERS = ("capability", "end_to_end")
LAYER_NAMES = {"capability": "capability", "end_to_end": "end-to-end"}


def layer_of(domain: Any) -> str:
    """A domain's evaluation layer: end-to-end when its tasks are episodes in an environment."""
    return "end_to_end" if getattr(domain, "environment", "single_turn") != "single_turn" else "capability"


def base_version(version: PolicyVersion) -> PolicyVersion | None:
    """Version 0 of the version's run: the base model itself."""
    return PolicyVersion.objects.filter(run_id=version.run_id, number=0).first()


def check_gate(version: PolicyVersion, alias: str, baseline: PolicyVersion | None, config: GateConfig) -> list[str]:
    """The reasons promotion of ``version`` to ``alias`` is refused (empty: the gate passes)."""
    if alias not in config.aliases:
        return []
    reference = baseline if baseline is not None else base_version(version)
    if reference is None or reference.pk == version.pk:
        return [] if reference is not None else [
            f"nothing to compare v{version.number} with: evaluate the base model (version 0) of run "
            f"{version.run_id} first"]
    comparison = compare(version, reference, config.suite)
    reasons = []
    label = f"v{reference.number} of run {reference.run_id}" + (" (base model)" if reference.number == 0 else "")
    missing = [d.domain for d in comparison.domains if d.score is None or d.baseline is None]
    if not comparison.domains:
        reasons.append(f"v{version.number} has no '{config.suite}' evaluation: evaluate it first")
    elif missing:
        reasons.append(f"not evaluated on both sides for: {', '.join(missing)} (evaluate v{version.number} and "
                       f"{label})")
    if config.require_no_regression:
        for d in comparison.regressions:
            assert d.ci95 is not None and d.delta is not None
            reasons.append(f"{LAYER_NAMES[d.layer]} layer: {d.domain} regressed against {label}: {d.delta:+.3f} "
                           f"(95% CI {d.ci95[0]:+.3f} to {d.ci95[1]:+.3f})")
    if comparison.average is not None and comparison.baseline_average is not None:
        gain = comparison.average - comparison.baseline_average
        if gain < config.min_gain:
            reasons.append(f"average gain {gain:+.3f} over {label} is below the gate's minimum {config.min_gain:+.3f}")
    return reasons


def ensure_base_version(run_id: int) -> PolicyVersion:
    """Version 0 of a run (the base model itself), created on first need so it can be evaluated and compared."""
    version, _ = PolicyVersion.objects.get_or_create(run_id=run_id, number=0, defaults={"step": 0})
    return version


def do_request_evaluation(version: PolicyVersion, *, samples: int = 1, actor: Any = None) -> dict[str, Any]:
    """Mark the version's held-out evaluations pending and queue the evaluation job on the rollout queue.

    ``samples`` = 1 evaluates greedily; k > 1 samples k completions per task and scores pass@k.
    """
    from django.db import transaction

    from webapp.runs.services import record_event

    domains = list(version.run.run_domains.values_list("domain_id", flat=True))
    with transaction.atomic():
        for domain_id in domains:
            Evaluation.objects.update_or_create(
                version=version, domain_id=domain_id, suite="heldout",
                defaults={"status": Evaluation.Status.PENDING, "n_samples": samples})
        record_event(version.run_id, "evaluation.requested",
                     f"evaluation of v{version.number} requested ({'greedy' if samples == 1 else f'pass@{samples}'})",
                     actor=actor, data={"version": version.number, "samples": samples})

        transaction.on_commit(partial(messages.evaluate, version.run_id, version.number))
    return {"version": version.number, "samples": samples, "domains": len(domains), "status": "pending"}


def resolve_baseline(version: PolicyVersion, against: str, visible: QuerySet[Any]) -> PolicyVersion | None:
    """``parent``, ``base``, an alias name, or a version id, as a PolicyVersion (404-style error if unknown)."""
    from webapp.runs import services

    if against == "parent":
        return version.parent or base_version(version)
    if against == "base":
        return base_version(version)
    if against in Alias.values:
        return services.current_alias(version.run.base_model, against)
    if against.isdigit() and (row := visible.filter(pk=int(against)).first()) is not None:
        return row
    raise ValidationFailed(f"cannot compare against {against!r}",
                           details={"against": ["parent, base, an alias name or a version id you can see"]})
