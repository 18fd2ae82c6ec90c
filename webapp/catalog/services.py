"""State changes of the catalog, each a named function (the only writers besides the import module)."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, cast

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import transaction
from django.utils import timezone

from webapp.catalog.models import CalibrationReport, CalibrationStatus, TaskDomain, Verifier
from webapp.catalog.task_import import ImportFailed, ImportResult, import_tasks
from webapp.common.errors import InvalidTransition
from workers import messages

log = logging.getLogger(__name__)

__all__ = ["ImportFailed", "ImportResult", "check_domain", "check_verifier", "do_import_tasks", "do_record_calibration",
           "do_request_calibration", "do_run_calibration"]

do_import_tasks = import_tasks


def check_domain(*, kind: str, verifier: Verifier | None, prompt_template: str = "",
                 domain: TaskDomain | None = None, environment: str = "single_turn",
                 environment_params: dict[str, Any] | None = None) -> dict[str, list[str]]:
    """Problems of a domain's settings, by field (empty when it is fine). The API, the pages and the admin
    all ask this one function: a verifier that cannot judge the kind, a template naming a field the kind
    does not show, an unknown environment or parameters it refuses, a kind changed under tasks already
    stored in the old kind's shape."""
    from workers.domains.kinds import attach_problem
    from workers.domains.prompts import check_template

    problems: dict[str, list[str]] = {}
    if verifier is not None and (why := attach_problem(verifier.kind, kind)):
        problems["verifier"] = [f"{verifier.name!r}: {why}"]
    if template_problems := check_template(kind, prompt_template):
        problems["prompt_template"] = template_problems
    from workers.environments.base import EnvironmentError_, validate_params

    try:
        validate_params(environment, environment_params)
    except EnvironmentError_ as exc:
        field = "environment" if any(p.startswith("environment:") for p in exc.problems) else "environment_params"
        problems[field] = [p.split(": ", 1)[-1] if field == "environment" else p for p in exc.problems]
    if domain is not None and domain.pk and kind != domain.kind and domain.tasks.exists():
        problems["kind"] = [f"the domain already holds {domain.task_count} {domain.kind} task(s); a kind cannot "
                            "change under them: create a new domain"]
    return problems


def check_verifier(kind: str, cases: list[dict[str, Any]] | None, verifier: Verifier | None = None,
                   config: dict[str, Any] | None = None) -> dict[str, list[str]]:
    """Problems of a verifier's kind and calibration cases, by field: a case whose reference is not in the
    shape the kind's domains store (it would calibrate against references no task has), a kind changed
    under domains it cannot judge, and for ``python_reward`` (given its ``config``) the first calibration
    case the user's code fails on (``reward_dry_run``; ``cases`` None: the verifier's stored ones)."""
    from workers.domains.kinds import ShapeError, attach_problem, domain_kinds_for, parse_reference

    problems: dict[str, list[str]] = {}
    kinds = domain_kinds_for(kind)
    for i, case in enumerate(cases or []):
        try:
            parse_reference(case.get("reference"), kinds)
        except ShapeError as exc:
            problems.setdefault("calibration_cases", []).append(
                f"case {i + 1}: reference {str(exc)[:300]} (a {kind} verifier judges {', '.join(kinds)} tasks; "
                "write the reference as such a task stores it)")
    if verifier is not None and verifier.pk and kind != verifier.kind:
        for domain in verifier.domains.all()[:20]:
            if why := attach_problem(kind, domain.kind):
                problems.setdefault("kind", []).append(f"attached to domain {domain.name!r}: {why}")
    if kind == "python_reward" and config is not None and not problems:
        if cases is None and verifier is not None and verifier.pk:
            cases = [dict(c) for c in verifier.calibration_cases.values("prompt", "completion", "reference")]
        if cases and (why := reward_dry_run(config, cases)):
            problems["config"] = [f"dry run on the calibration cases: {why}"]
    return problems


def reward_dry_run(config: dict[str, Any], cases: list[dict[str, Any]]) -> str | None:
    """The first calibration case a ``python_reward`` verifier's code fails on (an exception with its line,
    a limit, a non-numeric or out-of-range return), judged now in one sandbox execution; None when it
    passes them all or the config is invalid (reported as such by the caller).

    Skipped (None) where this process's sandbox has no namespace isolation (an unprivileged web container):
    the user's code is then first run by calibration, on a sandbox worker.
    """
    import sandboxes
    from workers.verifiers.base import JudgeInput, VerifierConfigError, build_verifier
    from workers.verifiers.python_reward import PythonRewardVerifier

    try:
        verifier = build_verifier("python_reward", config)
    except VerifierConfigError:
        return None
    assert isinstance(verifier, PythonRewardVerifier)
    if sandboxes.probe_tier() == "rlimits-only" and verifier.config.limits.require_isolation:
        log.warning("python_reward dry run skipped: no isolated sandbox in this process")
        return None
    return verifier.dry_run([JudgeInput(str(c.get("prompt", "")), str(c.get("completion", "")), c.get("reference"))
                             for c in cases])


def do_request_calibration(verifier: Verifier, actor: AbstractBaseUser | AnonymousUser | None = None) -> CalibrationReport:
    """Create a pending calibration report and queue its job on the ``verify`` queue after commit."""
    if not verifier.calibration_cases.exists():
        raise InvalidTransition(
            f"verifier {verifier.name!r} has no calibration cases: add known-good, known-bad and hack cases first"
        )
    with transaction.atomic():
        report = CalibrationReport.objects.create(verifier=verifier)
        Verifier.objects.filter(pk=verifier.pk).update(calibration_status=CalibrationStatus.RUNNING)

        transaction.on_commit(partial(messages.calibrate_verifier, report.pk))
    return report


def do_run_calibration(report: CalibrationReport) -> CalibrationReport:
    """Judge the report's verifier on its calibration cases now, in this process, and record the outcome.

    A verifier that cannot be built or crashes is recorded as an error on the report, not lost in a log.
    """
    from workers.verifiers.base import JudgeInput, build_verifier
    from workers.verifiers.calibration import CalibrationCase, calibrate

    verifier_row = report.verifier
    try:
        verifier = build_verifier(verifier_row.kind, verifier_row.config)
        cases = [
            CalibrationCase(input=JudgeInput(prompt=c.prompt, completion=c.completion, reference=c.reference),
                            expected=cast(Any, c.expected), label=cast(Any, c.label))
            for c in verifier_row.calibration_cases.all()
        ]
        outcome = calibrate(cast(Any, verifier), cases)
    except Exception as exc:
        log.exception("calibration %s failed", report.pk)
        do_record_calibration(report, passed=None, summary={}, error=f"{type(exc).__name__}: {exc}")
        return report
    do_record_calibration(report, passed=outcome.passed, summary=outcome.to_dict())
    return report


def do_record_calibration(report: CalibrationReport, *, passed: bool | None, summary: dict[str, Any], error: str = "") -> None:
    """Store a finished calibration and move the verifier's status accordingly."""
    report.status = CalibrationReport.Status.ERROR if error else CalibrationReport.Status.DONE
    report.passed = passed
    report.summary = summary
    report.error = error
    report.finished_at = timezone.now()
    report.save(update_fields=["status", "passed", "summary", "error", "finished_at", "updated_at"])
    status = CalibrationStatus.ERROR if error else (CalibrationStatus.PASSED if passed else CalibrationStatus.FAILED)
    Verifier.objects.filter(pk=report.verifier_id).update(calibration_status=status, updated_at=timezone.now())
