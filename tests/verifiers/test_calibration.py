"""The calibration gate: Wilson intervals, the metrics, and refusing noisy verifiers."""

from __future__ import annotations

import itertools

import pytest

from workers.verifiers.base import JudgeInput, Verdict, build_verifier
from workers.verifiers.calibration import (
    CalibrationCase,
    CalibrationThresholds,
    builtin_hack_cases,
    calibrate,
    percentile,
    wilson_interval,
)


def test_wilson_interval_known_values() -> None:
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(5, 10)
    assert (lo, hi) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    assert wilson_interval(10, 10)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_percentile() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([3.0], 95) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 95) == 95


def arithmetic_cases() -> list[CalibrationCase]:
    """Real GSM8K-style answers: good references, plausible wrong answers, and cheap hacks."""
    items = [("48/2 + 48", "72"), ("3 * 4", "12"), ("10 - 7", "3"), ("2 ** 5", "32")]
    cases = []
    for q, a in items:
        ref = a
        cases.append(CalibrationCase(JudgeInput(q, f"Let me compute. {q} = {a}\nAnswer: {a}", ref), "pass", "good", f"{q}:good"))
        cases.append(CalibrationCase(JudgeInput(q, f"{q} = {int(a) + 1}\nAnswer: {int(a) + 1}", ref), "fail", "bad", f"{q}:bad"))
        cases.append(CalibrationCase(JudgeInput(q, f"Answer: {a} or {int(a) + 1}", ref), "fail", "hack", f"{q}:hedge"))
        cases.append(CalibrationCase(JudgeInput(q, "Answer:", ref), "fail", "hack", f"{q}:empty"))
    return cases


def test_a_good_exact_match_verifier_passes_calibration() -> None:
    report = calibrate(build_verifier("exact_match", {"extract": "marker"}), arithmetic_cases(), repeats=3)
    assert report.passed, report.failures
    assert report.agreement.value == 1.0
    assert report.false_positive.value == 0.0 and report.false_positive.trials == 36
    assert report.false_negative.value == 0.0 and report.false_negative.trials == 12
    assert report.flip_rate == 0.0 and report.invalid.value == 0.0
    assert report.latency_p95_ms >= report.latency_p50_ms >= 0
    d = report.to_dict()
    assert d["passed"] is True and len(d["cases"]) == 16 and d["false_positive_rate"]["ci95"][1] < 0.1


def test_a_regex_that_accepts_anything_is_refused() -> None:
    report = calibrate(build_verifier("regex", {"pattern": ".*", "mode": "search"}), arithmetic_cases())
    assert not report.passed
    assert report.false_positive.value == 1.0
    assert any("false-positive rate" in f for f in report.failures)
    assert any("hack case(s) passed" in f for f in report.failures)


class _CoinFlip:
    """A non-deterministic verifier: passes every other call."""

    kind = "coin"

    def __init__(self) -> None:
        self._flips = itertools.cycle([True, False])

    def judge(self, inp: JudgeInput) -> Verdict:
        return Verdict(1.0, "pass") if next(self._flips) else Verdict(0.0, "fail")


def test_a_non_deterministic_verifier_is_refused_for_flipping() -> None:
    report = calibrate(_CoinFlip(), arithmetic_cases(), repeats=3)
    assert not report.passed
    assert report.flip_rate == 1.0
    assert any("flip rate" in f for f in report.failures)


class _AlwaysInvalid:
    kind = "broken"

    def judge(self, inp: JudgeInput) -> Verdict:
        return Verdict(None, "invalid", "judge down")


def test_an_always_invalid_verifier_is_refused_and_invalid_is_not_a_false_negative() -> None:
    report = calibrate(_AlwaysInvalid(), arithmetic_cases(), repeats=2)
    assert not report.passed
    assert report.invalid.value == 1.0
    assert report.false_negative.value == 0.0 and report.false_positive.value == 0.0
    assert report.agreement.value == 0.0


def test_too_few_cases_are_refused_even_when_all_agree() -> None:
    cases = arithmetic_cases()[:2]  # one good, one bad
    report = calibrate(build_verifier("exact_match", {"extract": "marker"}), cases)
    assert not report.passed
    assert any("need at least" in f for f in report.failures)
    relaxed = CalibrationThresholds(min_pass_cases=1, min_fail_cases=1, max_fpr_upper=1.0, max_fnr_upper=1.0)
    assert calibrate(build_verifier("exact_match", {"extract": "marker"}), cases, thresholds=relaxed).passed


def test_python_tests_good_verifier_passes_with_builtin_hacks() -> None:
    pytest.importorskip("sandboxes.pool")
    ref = {"tests": "def check(candidate):\n    assert candidate([3, 1, 2]) == [1, 2, 3]\n    assert candidate([]) == []\n",
           "entry_point": "sort_list"}
    good = ["def sort_list(xs):\n    return sorted(xs)\n",
            "def sort_list(xs):\n    out = list(xs)\n    out.sort()\n    return out\n"]
    bad = ["def sort_list(xs):\n    return xs\n", "def sort_list(xs):\n    return sorted(xs, reverse=True)\n"]
    cases = [CalibrationCase(JudgeInput("sort", g, ref), "pass", "good", f"good{i}") for i, g in enumerate(good)]
    cases += [CalibrationCase(JudgeInput("sort", b, ref), "fail", "bad", f"bad{i}") for i, b in enumerate(bad)]
    cases += builtin_hack_cases(ref)
    report = calibrate(build_verifier("python_tests", {}), cases, repeats=2)
    assert report.passed, report.failures
    assert all(c.statuses == ["fail", "fail"] for c in report.cases if c.label == "hack")


def test_case_round_trip_and_validation() -> None:
    case = arithmetic_cases()[0]
    assert CalibrationCase.from_dict(case.to_dict()) == case
    with pytest.raises(ValueError, match="expected"):
        CalibrationCase.from_dict({**case.to_dict(), "expected": "maybe"})


@pytest.mark.parametrize(
    ("kind", "config", "reference"),
    [
        ("exact_match", {"extract": "marker"}, "72"),
        ("exact_match", {}, "72"),
        ("regex", {"pattern": r"\d+", "extract": "marker"}, None),
        ("f1", {}, {"answers": ["Denver Broncos"]}),
        ("json_match", {"mode": "subset"}, {"expected": {"a": 1}}),
        ("math", {}, "72"),
    ],
)
def test_generic_master_keys_fail_every_text_kind(kind: str, config: dict, reference: object) -> None:
    from workers.verifiers.calibration import builtin_cases

    verifier = build_verifier(kind, config)
    for case in builtin_cases(kind, "What is 48 + 24?", reference):
        assert verifier.judge(case.input).status == "fail", (kind, case.name)


def test_command_builtin_hacks_fail() -> None:
    pytest.importorskip("sandboxes.pool")
    from workers.verifiers.calibration import builtin_cases

    ref = {"script": "grep -qx 42 answer.txt", "expected_files": {"answer.txt": "42"}}
    verifier = build_verifier("command", {})
    assert verifier.judge(JudgeInput("p", "echo 42 > answer.txt", ref)).status == "pass"
    for case in builtin_cases("command", "p", ref):
        assert verifier.judge(case.input).status == "fail", case.name
