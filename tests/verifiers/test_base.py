"""The verdict contract, the kinds table and config validation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workers.verifiers.base import (
    KINDS,
    BaseVerifier,
    JudgeInput,
    Verdict,
    VerifierConfig,
    VerifierConfigError,
    build_verifier,
    verifier_class,
)


def test_verdict_round_trips_through_json() -> None:
    v = Verdict(0.5, "fail", "half", {"nested": {"x": [1, 2.5, float("inf")], "b": b"\xff"}}, 12.3456)
    data = json.loads(json.dumps(v.to_dict()))
    assert data == {"score": 0.5, "status": "fail", "reason": "half",
                    "details": {"nested": {"x": [1, 2.5, "inf"], "b": "\ufffd"}}, "latency_ms": 12.346}
    again = Verdict.from_dict(data)
    assert (again.score, again.status, again.reason) == (0.5, "fail", "half")


@pytest.mark.parametrize(
    ("score", "status"),
    [(None, "pass"), (1.5, "pass"), (-0.1, "fail"), (float("nan"), "fail"), (0.0, "invalid"), (1.0, "maybe")],
)
def test_verdict_rejects_inconsistent_values(score: float | None, status: str) -> None:
    with pytest.raises(ValueError):
        Verdict(score, status)  # type: ignore[arg-type]


def test_every_kind_imports_and_has_a_config() -> None:
    for kind in KINDS:
        cls = verifier_class(kind)
        assert cls.kind == kind
        assert issubclass(cls.Config, VerifierConfig)


def test_unknown_kind_is_a_config_error() -> None:
    with pytest.raises(VerifierConfigError, match="kind: unknown verifier kind 'nope'"):
        build_verifier("nope", {})


def test_config_errors_are_field_level_lines() -> None:
    with pytest.raises(VerifierConfigError) as err:
        build_verifier("regex", {"pattern": "(", "mode": "sometimes", "typo": 1, "pass_threshold": 2})
    text = str(err.value)
    assert "pattern: " in text and "does not compile" in text
    assert "mode: Input should be 'full' or 'search'" in text
    assert "typo: unknown field" in text
    assert "pass_threshold: " in text
    assert len(err.value.problems) == 4


def test_nested_config_errors_name_the_path() -> None:
    with pytest.raises(VerifierConfigError, match=r"limits\.cpu_seconds: "):
        build_verifier("python_tests", {"limits": {"cpu_seconds": -1}})


def test_config_must_be_an_object() -> None:
    with pytest.raises(VerifierConfigError, match="expected a JSON object"):
        build_verifier("exact_match", ["not", "a", "dict"])  # type: ignore[arg-type]


def test_generate_only_for_llm_judge() -> None:
    with pytest.raises(VerifierConfigError, match="generate: only the llm_judge kind"):
        build_verifier("exact_match", {}, generate=lambda p: "x")


class _Crashing(BaseVerifier[VerifierConfig]):
    kind = "crashing"

    def _judge(self, inp: JudgeInput) -> Verdict:
        raise KeyError("boom")


def test_a_verifier_crash_is_invalid_not_zero() -> None:
    v = _Crashing(VerifierConfig()).judge(JudgeInput("p", "c", "r"))
    assert v.status == "invalid"
    assert v.score is None
    assert "KeyError" in (v.reason or "")
    assert v.latency_ms >= 0


def test_pure_package_imports_no_django_celery_or_sandbox_at_import_time() -> None:
    code = (
        "import sys, workers.verifiers.base, workers.verifiers.text, workers.verifiers.json_match, "
        "workers.verifiers.calibration, workers.verifiers.batch, workers.verifiers.llm_judge, "
        "workers.verifiers.python_tests, workers.verifiers.command, workers.verifiers.mathexpr, workers.verifiers.humaneval, "
        "workers.verifiers.python_reward\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('django', 'celery', 'torch', 'sandboxes', "
        "'math_verify', 'sympy')]\n"
        "print(bad)\nassert not bad, bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_normalized_config_and_schema_for_every_kind() -> None:
    from workers.verifiers.base import config_schema, normalized_config

    minimal = {"llm_judge": {"rubric": "r", "use_engine": True},
               "python_reward": {"code": "def score(prompt, completion, reference):\n    return 1.0\n"}}
    for kind in KINDS:
        cfg = normalized_config(kind, minimal.get(kind, {}))
        assert "pass_threshold" in cfg
        json.dumps(cfg)
        assert normalized_config(kind, cfg) == cfg  # stored configs validate to themselves
        schema = config_schema(kind)
        assert schema["type"] == "object" and "pass_threshold" in schema["properties"]
    assert normalized_config("json_match", {"schema": {"type": "object"}})["schema"] == {"type": "object"}


def test_builtin_cases_exist_for_every_kind_and_all_expect_fail() -> None:
    from workers.verifiers.calibration import builtin_cases

    for kind in KINDS:
        cases = builtin_cases(kind, "prompt", {"tests": "assert f() == 1", "entry_point": "f"})
        assert cases and all(c.expected == "fail" and c.label == "hack" for c in cases)


def test_get_verifier_is_memoised_by_canonical_config() -> None:
    from workers.verifiers.base import get_verifier

    a = get_verifier("exact_match", {"ignore_case": True, "extract": "marker"})
    b = get_verifier("exact_match", {"extract": "marker", "ignore_case": True})
    assert a is b
    assert get_verifier("exact_match", {}) is not a
    with pytest.raises(VerifierConfigError):
        get_verifier("exact_match", {"nope": 1})
