"""exact_match, regex and f1 on real and hostile inputs."""

from __future__ import annotations

import time

import pytest

from workers.verifiers.base import JudgeInput, build_verifier
from workers.verifiers.text import extract_answer, last_boxed, token_f1

GSM8K_STYLE = (
    "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and May.\n"
    "Answer: 72"
)


def judge(kind: str, config: dict, completion: str, reference: object) -> tuple[str, float | None, str | None]:
    v = build_verifier(kind, config).judge(JudgeInput("q", completion, reference))
    return v.status, v.score, v.reason


def test_last_boxed_handles_nested_braces_and_takes_the_last() -> None:
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{unclosed") is None
    assert last_boxed("no box") is None


@pytest.mark.parametrize(
    ("mode", "text", "expected"),
    [
        ("marker", GSM8K_STYLE, "72"),
        ("marker", "answer: 3\nmore text\nANSWER: 4\n", "4"),
        ("marker", "no marker here", None),
        ("last_line", "reasoning\n\n  42  \n\n", "  42  "),
        ("last_line", "   \n", None),
        ("boxed", r"so $\boxed{7}$.", "7"),
        ("none", "x", "x"),
    ],
)
def test_extract_answer(mode: str, text: str, expected: str | None) -> None:
    assert extract_answer(text, mode, "Answer:") == expected  # type: ignore[arg-type]


def test_exact_match_gsm8k_style() -> None:
    cfg = {"extract": "marker"}
    assert judge("exact_match", cfg, GSM8K_STYLE, "72")[0] == "pass"
    assert judge("exact_match", cfg, GSM8K_STYLE.replace("Answer: 72", "Answer: 71"), "72")[0] == "fail"
    status, score, reason = judge("exact_match", cfg, "I think it is 72", "72")
    assert (status, score) == ("fail", 0.0) and "no answer found" in (reason or "")


def test_exact_match_normalisation_options() -> None:
    assert judge("exact_match", {}, "  Paris \n", "Paris")[0] == "pass"
    assert judge("exact_match", {}, "paris", "Paris")[0] == "fail"
    assert judge("exact_match", {"ignore_case": True}, "PARIS", "paris")[0] == "pass"
    assert judge("exact_match", {}, "New   York", "New York")[0] == "pass"
    assert judge("exact_match", {"collapse_whitespace": False}, "New   York", "New York")[0] == "fail"
    assert judge("exact_match", {"remove_punctuation": True}, "Paris!", "Paris")[0] == "pass"
    assert judge("exact_match", {}, "Paris!", "Paris")[0] == "fail"
    # unicode compatibility forms (full-width digits) normalise to the same text
    assert judge("exact_match", {}, "\uff17\uff12", "72")[0] == "pass"


def test_exact_match_accepts_any_of_several_references() -> None:
    assert judge("exact_match", {"ignore_case": True}, "NYC", {"answers": ["New York", "NYC"]})[0] == "pass"
    assert judge("exact_match", {}, "7", 7)[0] == "pass"


def test_exact_match_unusable_reference_is_invalid() -> None:
    refs: list[object] = [None, {"wrong_key": 1}, [], {"answers": [{"x": 1}]}]
    for ref in refs:
        status, score, reason = judge("exact_match", {}, "x", ref)
        assert status == "invalid" and score is None and "unusable reference" in (reason or "")


def test_exact_match_hostile_completions_fail_quickly() -> None:
    start = time.perf_counter()
    assert judge("exact_match", {"extract": "boxed"}, "\\boxed{" * 50_000, "1")[0] == "fail"
    assert judge("exact_match", {}, "7" * 200_000, "7")[0] == "fail"  # over max_completion_chars
    assert judge("exact_match", {}, "\x00\ud800 72", "72")[0] == "fail"
    # an answer that lists every option is not an exact match
    assert judge("exact_match", {"extract": "marker"}, "Answer: 71 72 73", "72")[0] == "fail"
    assert time.perf_counter() - start < 5


def test_regex_full_and_search() -> None:
    cfg = {"pattern": r"-?\d+(\.\d+)?", "extract": "marker"}
    assert judge("regex", cfg, "Answer: -3.5", None)[0] == "pass"
    assert judge("regex", cfg, "Answer: about 3", None)[0] == "fail"
    search = {"pattern": r"\bparis\b", "mode": "search", "flags": ["IGNORECASE"]}
    assert judge("regex", search, "It is PARIS, of course.", None)[0] == "pass"
    assert judge("regex", search, "It is Parisian.", None)[0] == "fail"


def test_regex_pattern_from_reference() -> None:
    assert judge("regex", {}, "2024-01-31", {"pattern": r"\d{4}-\d{2}-\d{2}"})[0] == "pass"
    status, _, reason = judge("regex", {}, "x", {"pattern": "(unclosed"})
    assert status == "invalid" and "does not compile" in (reason or "")
    assert judge("regex", {}, "x", {"not": "a pattern"})[0] == "invalid"
    status, _, reason = judge("regex", {}, "x", {"answer": "x"})  # an answer is not a pattern
    assert status == "invalid" and "no pattern" in (reason or "")


def test_regex_catastrophic_backtracking_never_hangs() -> None:
    cfg = {"pattern": r"^(\w+\s?)*$", "timeout_seconds": 0.2, "strip": False}
    start = time.perf_counter()
    status, score, reason = judge("regex", cfg, "a" * 5000 + "!", None)
    assert time.perf_counter() - start < 5
    # the regex engine either proves no match quickly or times out; it must never hang
    if status == "invalid":
        assert score is None and "timed out" in (reason or "")
    else:
        assert status == "fail"


def test_regex_timeout_reported_as_invalid() -> None:
    cfg = {"pattern": r"(a|aa)+$", "timeout_seconds": 0.05, "mode": "search"}
    status, score, reason = judge("regex", cfg, "a" * 60 + "b", None)
    assert (status, score) == ("invalid", None)
    assert "timed out" in (reason or "")


@pytest.mark.parametrize(
    ("pred", "ref", "f1"),
    [
        ("Paris", "Paris", 1.0),
        ("the Paris", "Paris.", 1.0),  # articles and punctuation dropped
        ("The answer is Paris", "Paris", 0.5),
        ("London", "Paris", 0.0),
        ("", "", 1.0),
        ("", "Paris", 0.0),
        ("red red blue", "red blue blue", 2 / 3),
    ],
)
def test_token_f1(pred: str, ref: str, f1: float) -> None:
    assert token_f1(pred, ref)[0] == pytest.approx(f1)


def test_f1_verifier_threshold_and_best_reference() -> None:
    ref = {"answers": ["Denver Broncos", "The Broncos"]}
    status, score, _ = judge("f1", {}, "Broncos", ref)
    assert status == "pass" and score == pytest.approx(1.0)  # "The Broncos" → ["broncos"]
    status, score, _ = judge("f1", {"pass_threshold": 0.9}, "the Denver team", ref)
    assert status == "fail" and 0 < (score or 0) < 0.9
    assert judge("f1", {}, "anything", "the a an")[0] == "invalid"  # empty reference after normalisation
