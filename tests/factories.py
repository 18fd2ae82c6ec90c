"""Small builders for test rows (through the services where a service exists)."""

from __future__ import annotations

from typing import Any

from webapp.catalog.models import BaseModel, CalibrationStatus, TaskDomain, Verifier
from webapp.runs.models import Evaluation, PolicyVersion, Run
from webapp.runs.services import DomainWeight, do_create_run


def base_model(owner: Any, name: str = "tiny") -> BaseModel:
    return BaseModel.objects.create(owner=owner, name=name, path="/models/tiny")


def verifier(owner: Any, name: str = "exact", calibrated: bool = True) -> Verifier:
    return Verifier.objects.create(
        owner=owner, name=name, kind="exact_match", config={},
        calibration_status=CalibrationStatus.PASSED if calibrated else CalibrationStatus.NONE,
    )


def domain(owner: Any, name: str = "addition", kind: str = "answer", verifier_row: Verifier | None = None,
           environment: str = "single_turn", environment_params: dict[str, Any] | None = None) -> TaskDomain:
    return TaskDomain.objects.create(owner=owner, name=name, kind=kind, verifier=verifier_row,
                                     environment=environment, environment_params=environment_params or {})


def run(owner: Any, calibrated: bool = True, name: str = "r1") -> Run:
    v = verifier(owner, name=f"v-{name}", calibrated=calibrated)
    d = domain(owner, name=f"d-{name}", verifier_row=v)
    return do_create_run(owner, name=name, base_model=base_model(owner, name=f"bm-{name}"), domains=[DomainWeight(d)])


def evaluation(version: PolicyVersion, domain: TaskDomain, scores: list[float], suite: str = "heldout") -> Evaluation:
    """A finished evaluation of ``version`` on ``domain``: task i scored ``scores[i]`` (tasks keyed "t<i>")."""
    return Evaluation.objects.create(
        version=version, domain=domain, suite=suite, status=Evaluation.Status.DONE, n_tasks=len(scores),
        score=sum(scores) / len(scores), pass_rate=sum(s >= 1.0 for s in scores) / len(scores),
        results={"greedy": True, "tasks": [[f"t{i}", s] for i, s in enumerate(scores)]},
    )
