"""math: math-verify equivalence, invalid on timeouts, and the non-main-thread path."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from workers.verifiers import mathexpr
from workers.verifiers.base import JudgeInput, Verdict, build_verifier


def judge(completion: str, reference: Any, config: dict | None = None) -> Verdict:
    return build_verifier("math", config or {}).judge(JudgeInput("q", completion, reference))


@pytest.mark.parametrize(
    ("completion", "reference"),
    [
        (r"The answer is $\frac{1}{2}$.", "0.5"),
        (r"So the result is \boxed{0.5}", r"\frac{1}{2}"),
        (r"Therefore $x = \boxed{2\sqrt{2}}$", r"\sqrt{8}"),
        (r"\boxed{1+x}", "x+1"),
        ("Natalia sold 72 clips. The answer is 72.", "72"),
        (r"\boxed{\{1, 2, 3\}}", r"\{3,2,1\}"),
        (r"$\boxed{(1, 2]}$", r"(1, 2]"),
        (r"$\boxed{50\%}$", "0.5"),
    ],
)
def test_equivalent_answers_pass(completion: str, reference: str) -> None:
    v = judge(completion, reference)
    assert v.status == "pass", v
    assert v.details["parsed_prediction"]


@pytest.mark.parametrize(
    ("completion", "reference"),
    [
        (r"\boxed{0.75}", "1/2"),
        (r"\boxed{x+2}", "x+1"),
        ("I don't know.", "72"),
        ("", "3"),
        (r"\boxed{3.14}", r"\pi"),
    ],
)
def test_wrong_or_missing_answers_fail(completion: str, reference: str) -> None:
    v = judge(completion, reference)
    assert v.status == "fail" and v.score == 0.0, v


def test_unparseable_reference_is_invalid() -> None:
    for reference in ("???", "", "\\frac{"):
        v = judge(r"\boxed{1}", reference)
        assert v.status == "invalid" and "cannot parse the reference" in (v.reason or ""), (reference, v)
    assert judge(r"\boxed{1}", None).status == "invalid"


def test_reference_dict_and_number() -> None:
    assert judge(r"\boxed{42}", {"answer": "42"}).status == "pass"
    assert judge(r"\boxed{42}", 42).status == "pass"


def test_hostile_inputs_fail_or_invalid_never_crash() -> None:
    for completion in ("\\boxed{" * 2000, "$" * 10_000, "\\frac{" * 500 + "}" * 500, "x" * 200_000):
        v = judge(completion, "1")
        assert v.status in ("fail", "invalid"), v


def test_timeout_in_main_thread_is_invalid(monkeypatch: pytest.MonkeyPatch) -> None:
    import math_verify.grader

    real = math_verify.grader.sympy_expr_eq

    def slow(*args: Any, **kwargs: Any) -> bool:
        time.sleep(5)
        return real(*args, **kwargs)

    monkeypatch.setattr(math_verify.grader, "sympy_expr_eq", slow)
    start = time.perf_counter()
    v = judge(r"\boxed{3}", "3", {"timeout_seconds": 1})
    assert time.perf_counter() - start < 4.5
    assert v.status == "invalid" and "timed out" in (v.reason or ""), v


def _in_thread(fn: Any) -> Verdict:
    box: list[Verdict] = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join(30)
    return box[0]


def test_works_in_a_non_main_thread() -> None:
    v = _in_thread(lambda: judge(r"\boxed{\frac{2}{4}}", "0.5"))
    assert v.status == "pass", v
    v = _in_thread(lambda: judge(r"\boxed{7}", "0.5"))
    assert v.status == "fail", v


def test_non_main_thread_overrun_is_invalid_and_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    import math_verify.grader

    release = threading.Event()
    real = math_verify.grader.sympy_expr_eq

    def stuck(*args: Any, **kwargs: Any) -> bool:
        release.wait(20)
        return real(*args, **kwargs)

    monkeypatch.setattr(math_verify.grader, "sympy_expr_eq", stuck)
    monkeypatch.setattr(mathexpr, "_runaway", set())
    cfg = {"timeout_seconds": 1, "max_runaway_threads": 1}
    try:
        start = time.perf_counter()
        first = _in_thread(lambda: judge(r"\boxed{3}", "3", cfg))
        assert time.perf_counter() - start < 6
        assert first.status == "invalid" and "timed out" in (first.reason or "")
        # the abandoned computation still runs: the next judgment refuses at once instead of piling up
        start = time.perf_counter()
        second = _in_thread(lambda: judge(r"\boxed{3}", "3", cfg))
        assert time.perf_counter() - start < 1
        assert second.status == "invalid" and "saturated" in (second.reason or "")
    finally:
        release.set()
