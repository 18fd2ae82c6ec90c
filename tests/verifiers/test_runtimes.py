"""Verifiers name their sandbox runtime: a numpy code domain judged right in the numpy runtime, and invalid
with the reason (never a 0) on the default runtime, which has only the standard library; calibration runs
in the verifier's runtime; the command kind's Python test script runs the runtime's interpreter.

The numpy image is built once per machine (``var/runtimes``; ~7 s the first time).
"""

from __future__ import annotations

from typing import Any

import pytest

from workers.verifiers.base import JudgeInput, Verdict, VerifierConfigError, build_verifier
from workers.verifiers.calibration import CalibrationCase, calibrate

pytest.importorskip("sandboxes.pool")

NORMALIZE_TESTS = """\
import numpy as np
assert np.allclose(normalize(np.array([3.0, 4.0])), [0.6, 0.8])
assert np.isclose(np.linalg.norm(normalize(np.arange(1.0, 5.0))), 1.0)
"""
GOOD = "```python\nimport numpy as np\n\ndef normalize(v):\n    return v / np.linalg.norm(v)\n```"
BAD = "```python\ndef normalize(v):\n    return v / v.sum()\n```"
NUMPY = {"runtime": "numpy", "strict_values": False}  # (numpy values are not plain data: see python_tests)


@pytest.fixture(scope="module", autouse=True)
def numpy_image() -> None:
    from sandboxes import runtimes

    runtimes.ensure_image(runtimes.get("numpy"))


def judge(completion: str, **config: Any) -> Verdict:
    return build_verifier("python_tests", config).judge(
        JudgeInput("Write normalize(v): v scaled to unit length.", completion, {"tests": NORMALIZE_TESTS}, kind="code"))


def test_a_numpy_domain_judges_known_good_and_bad_solutions_in_its_runtime() -> None:
    good, bad = judge(GOOD, **NUMPY), judge(BAD, **NUMPY)
    assert good.status == "pass", good
    assert good.details["runtime"] == "numpy" and good.details["sandbox_start"] in ("warm", "cold")
    assert bad.status == "fail" and bad.score == 0.0, bad


@pytest.mark.parametrize("completion", [GOOD, BAD], ids=["good", "bad"])
def test_on_the_default_runtime_numpy_is_missing_invalid_with_the_reason(completion: str) -> None:
    verdict = judge(completion, strict_values=False)
    assert verdict.status == "invalid" and verdict.score is None, verdict
    assert verdict.reason is not None and "runtime 'python' has no module 'numpy'" in verdict.reason
    assert verdict.details["missing_module"] == "numpy" and verdict.details["runtime"] == "python"


def test_a_solution_importing_what_the_tests_do_not_need_is_its_own_failure() -> None:
    verdict = build_verifier("python_tests", {}).judge(JudgeInput(
        "Write add.", "import numpy\ndef add(a, b):\n    return a + b\n", "assert add(1, 2) == 3\n"))
    assert verdict.status == "fail" and "ModuleNotFoundError" in (verdict.reason or ""), verdict


def test_calibration_runs_in_the_verifiers_runtime() -> None:
    verifier = build_verifier("python_tests", NUMPY)
    case = lambda completion, expected: CalibrationCase(  # noqa: E731
        JudgeInput("normalize", completion, {"tests": NORMALIZE_TESTS}, kind="code"), expected, "good")
    cases = [case(GOOD, "pass"), case(GOOD.replace("np.linalg.norm(v)", "np.sqrt((v * v).sum())"), "pass"),
             case(BAD, "fail"), case("def normalize(v):\n    return v\n", "fail"),
             case("def normalize(v):\n    return v * 0.5\n", "fail"), case("def normalize(v):\n    return v ** 2\n", "fail"),
             case("def normalize(v):\n    return v - v.mean()\n", "fail")]
    report = calibrate(verifier, cases, repeats=3)
    assert report.passed, report.to_dict()
    assert report.invalid.count == 0


def test_an_unknown_runtime_is_refused_when_the_verifier_is_configured() -> None:
    with pytest.raises(VerifierConfigError, match=r"runtime: unknown sandbox runtime 'numpi'; defined: .*numpy"):
        build_verifier("python_tests", {"runtime": "numpi"})


def test_a_command_python_script_runs_the_runtimes_interpreter() -> None:
    reference = {"script": "import numpy as np\nassert np.loadtxt('out.txt').sum() == 6\n", "interpreter": "python"}
    completion = "```bash\nprintf '1\\n2\\n3\\n' > out.txt\n```"
    inp = JudgeInput("Write 1, 2, 3 to out.txt", completion, reference, kind="command")
    assert build_verifier("command", {"runtime": "numpy"}).judge(inp).status == "pass"
    assert build_verifier("command", {}).judge(inp).status == "fail"  # the system's python3 has no numpy
