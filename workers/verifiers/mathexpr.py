"""``math``: mathematical equivalence through math-verify (parse with LaTeX/expression extraction, then
symbolic/numeric comparison), e.g. ``\\frac{1}{2}`` = ``0.5`` = ``1/2``; ``x+1`` = ``1+x``.

Timeouts. math-verify bounds ``parse``/``verify`` with ``signal.alarm``, which only works in a process's
main thread, and on a timeout it quietly returns "not equal" — a verifier timeout scored as a wrong
answer. So this kind:

* calls math-verify with ``raise_on_error=True`` and one ``verify`` per (gold, prediction) pair, so a
  timeout is seen and becomes an **invalid** verdict (reason "math-verify timed out"), never a 0;
* in the main thread (Celery prefork workers, the CLI) lets math-verify use its alarm (whole seconds);
* in any other thread (a thread pool, a web request handler) disables math-verify's alarm and instead runs
  the parse+verify in a daemon helper thread joined with the same deadline. Python cannot kill a thread,
  so a computation that overruns is abandoned (it finishes or burns CPU in the background) and the
  verdict is invalid. A guard counts abandoned threads still running; at ``max_runaway_threads`` new
  judgments in non-main threads return invalid at once instead of piling up more runaway work.

What it does NOT catch: math-verify takes the *last* boxed/marked answer it can parse, so a completion that
hedges with several answers is judged on the one math-verify extracts (see ``details.parsed_prediction``).
Equivalence is numeric to ``float_rounding`` decimals: 3.14159265 "equals" pi at 6 decimals. Units, text
answers and intervals written in prose are outside its parser; use exact_match or llm_judge there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field

from workers.verifiers.base import (
    BaseVerifier,
    InvalidReference,
    JudgeInput,
    Verdict,
    VerifierConfig,
    invalid,
    scored,
)

logger = logging.getLogger(__name__)


ExtractionName = Literal["latex", "expr", "string"]


def _default_extraction() -> list[ExtractionName]:
    return ["latex", "expr"]


class MathConfig(VerifierConfig):
    extraction: list[ExtractionName] = Field(
        default_factory=_default_extraction,
        min_length=1,
        description="What math-verify extracts from the completion: LaTeX, plain expressions, letters (A-D).",
    )
    float_rounding: int = Field(default=6, ge=0, le=15)
    numeric_precision: int = Field(default=15, ge=1, le=100)
    strict: bool = Field(default=True, description="Variables matter; sets and tuples are not interchangeable.")
    timeout_seconds: int = Field(default=5, ge=1, le=120, description="Per parse/compare step; overrun → invalid.")
    max_completion_chars: int = Field(default=100_000, gt=0)
    max_runaway_threads: int = Field(default=2, ge=1, description="See the module docstring (non-main threads).")


class _Timeout(Exception):
    pass


_runaway_lock = threading.Lock()
_runaway: set[threading.Thread] = set()


def _alive_runaways() -> int:
    with _runaway_lock:
        for t in [t for t in _runaway if not t.is_alive()]:
            _runaway.discard(t)
        return len(_runaway)


def _extraction_targets(names: Sequence[str]) -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, StringExtractionConfig

    table: dict[str, Callable[[], Any]] = {
        "latex": LatexExtractionConfig,
        "expr": ExprExtractionConfig,
        "string": StringExtractionConfig,
    }
    return [table[n]() for n in names]


class MathVerifier(BaseVerifier[MathConfig]):
    kind: ClassVar[str] = "math"
    Config = MathConfig

    def __init__(self, config: MathConfig) -> None:
        super().__init__(config)
        self._targets = _extraction_targets(config.extraction)
        self._gold_targets = _extraction_targets(["latex", "expr"])

    # The core; ``alarm`` is the per-step timeout handed to math-verify (None: no signal use).
    def _compare(self, gold_text: str, completion: str, alarm: int | None) -> Verdict:
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException

        c = self.config
        try:
            gold: list[Any] = []
            # A bare reference ("(1, 2]", "x+1") is read as LaTeX first; one with its own delimiters as is.
            delimited = "$" in gold_text or "\\boxed" in gold_text
            for candidate in ((gold_text,) if delimited else (f"${gold_text}$", gold_text)):
                try:
                    gold = parse(candidate, self._gold_targets, fallback_mode="no_fallback",
                                 parsing_timeout=alarm, raise_on_error=True)
                except Exception:
                    gold = []
                if gold:
                    break
            if not gold:
                raise InvalidReference(f"math-verify cannot parse the reference {gold_text[:200]!r}")
            try:
                pred = parse(completion, self._targets, parsing_timeout=alarm,
                             raise_on_error=True)
            except Exception as exc:
                return scored(0.0, c.pass_threshold, f"no parsable answer ({type(exc).__name__})")
            details = {"parsed_reference": [str(g)[:200] for g in gold],
                       "parsed_prediction": [str(p)[:200] for p in pred]}
            if not pred:
                return scored(0.0, c.pass_threshold, "no parsable answer in the completion", **details)
            errors: list[str] = []
            for g in gold:
                for p in pred:
                    try:
                        if verify(g, p, float_rounding=c.float_rounding, numeric_precision=c.numeric_precision,
                                  strict=c.strict, timeout_seconds=alarm, raise_on_error=True):
                            return scored(1.0, c.pass_threshold, None, **details)
                    except Exception as exc:  # a failed comparison strategy means "not shown equal"
                        errors.append(f"{type(exc).__name__}: {exc}"[:200])
            if errors:
                details["comparison_errors"] = errors[:5]
            return scored(0.0, c.pass_threshold, "answer is not equivalent to the reference", **details)
        except TimeoutException:
            raise _Timeout() from None

    def _judge(self, inp: JudgeInput) -> Verdict:
        c = self.config
        refs = self.reference_answers(inp)
        if len(inp.completion) > c.max_completion_chars:
            return scored(0.0, c.pass_threshold, f"completion longer than {c.max_completion_chars} characters")
        gold_text = refs[0]
        if threading.current_thread() is threading.main_thread():
            try:
                return self._compare(gold_text, inp.completion, c.timeout_seconds)
            except _Timeout:
                return invalid(f"math-verify timed out (>{c.timeout_seconds}s per step)")
        return self._judge_in_helper_thread(gold_text, inp.completion)

    def _judge_in_helper_thread(self, gold_text: str, completion: str) -> Verdict:
        c = self.config
        if _alive_runaways() >= c.max_runaway_threads:
            return invalid("math verifier saturated: earlier judgments are still running past their deadline")
        box: dict[str, Any] = {}
        import math_verify.grader
        import math_verify.parser

        # We bound the work ourselves (the join below): silence math-verify's "timeout disabled" warning.
        math_verify.parser.TIMEOUT_WARNING_SHOWN = True
        math_verify.grader.TIMEOUT_WARNING_SHOWN = True

        def work() -> None:
            try:
                box["verdict"] = self._compare(gold_text, completion, None)
            except BaseException as exc:  # delivered to the caller below
                box["error"] = exc

        helper = threading.Thread(target=work, name="math-verify", daemon=True)
        helper.start()
        # Parse of reference + prediction + comparisons: a budget of a few steps, like the alarm path.
        helper.join(timeout=3 * c.timeout_seconds)
        if helper.is_alive():
            with _runaway_lock:
                _runaway.add(helper)
            logger.warning("math-verify overran %ss in a non-main thread; abandoning it", 3 * c.timeout_seconds)
            return invalid(f"math-verify timed out (>{3 * c.timeout_seconds}s, non-main thread)")
        if "error" in box:
            raise box["error"]
        verdict: Verdict = box["verdict"]
        return verdict
