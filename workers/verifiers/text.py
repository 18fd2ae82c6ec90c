"""Text verifiers: ``exact_match``, ``regex`` and ``f1`` (document QA), plus the answer extraction and
normalisation they share.

Extraction picks the answer out of a completion before comparing: the text after the last marker
(``"Answer:"``), the last non-empty line, or the last ``\\boxed{...}``. When extraction finds nothing the
verdict is ``fail`` ("no answer found") — that is the completion's fault, not the verifier's.

What these kinds do NOT catch:

* ``exact_match`` compares strings only: "0.5" vs "1/2" or "Paris" vs "Paris, France" fail (use ``math``
  or ``f1``). Without extraction a right answer wrapped in prose fails; with ``extract="marker"`` a
  completion that states several answers after several markers is judged on the last one only.
* ``regex`` is exactly as strict as its pattern: a loose ``search`` pattern rewards any completion that
  contains the string anywhere (e.g. one that enumerates every option). Calibrate it with bad cases.
  Catastrophic backtracking is bounded by the ``regex`` engine's timeout (→ invalid), not prevented.
* ``f1`` rewards token overlap, not truth: "not Paris" shares a token with "Paris", and answers padded
  with the question's words score well on recall. Keep the threshold meaningful and calibrate.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from typing import ClassVar, Literal

import regex
from pydantic import Field, field_validator

from workers.verifiers.base import (
    BaseVerifier,
    InvalidReference,
    JudgeInput,
    Verdict,
    VerifierConfig,
    scored,
)

ExtractMode = Literal["none", "marker", "last_line", "boxed"]


class ExtractionConfig(VerifierConfig):
    extract: ExtractMode = Field(
        default="none",
        description="How to pick the answer out of the completion: whole text, after the last `marker`, "
        "the last non-empty line, or the last \\boxed{...}.",
    )
    marker: str = Field(default="Answer:", min_length=1, description="Used when extract='marker'.")
    max_completion_chars: int = Field(
        default=100_000, gt=0, description="Longer completions fail without being examined (bounds work)."
    )


# ---------------------------------------------------------------- extraction


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced; None if absent."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def extract_answer(text: str, mode: ExtractMode, marker: str = "Answer:") -> str | None:
    """The answer part of ``text`` under ``mode``; None when the mode finds nothing."""
    if mode == "none":
        return text
    if mode == "marker":
        idx = text.lower().rfind(marker.lower())
        if idx < 0:
            return None
        rest = text[idx + len(marker) :].strip()
        return rest.splitlines()[0] if rest else None
    if mode == "last_line":
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return lines[-1] if lines else None
    if mode == "boxed":
        return last_boxed(text)
    raise ValueError(f"unknown extract mode {mode!r}")


def _extract_or_none(cfg: ExtractionConfig, completion: str) -> tuple[str | None, str | None]:
    """(answer, reason-if-none)."""
    if len(completion) > cfg.max_completion_chars:
        return None, f"completion longer than {cfg.max_completion_chars} characters"
    answer = extract_answer(completion, cfg.extract, cfg.marker)
    if answer is None:
        return None, f"no answer found (extract={cfg.extract})"
    return answer, None


_PUNCT_TABLE = {ord(c): None for c in string.punctuation}


def normalize(
    text: str,
    *,
    strip: bool = True,
    ignore_case: bool = False,
    collapse_whitespace: bool = True,
    remove_punctuation: bool = False,
) -> str:
    text = unicodedata.normalize("NFKC", text)
    if remove_punctuation:
        text = "".join(ch for ch in text.translate(_PUNCT_TABLE) if not unicodedata.category(ch).startswith("P"))
    if ignore_case:
        text = text.casefold()
    if collapse_whitespace:
        text = " ".join(text.split())
    elif strip:
        text = text.strip()
    if strip:
        text = text.strip()
    return text


# ---------------------------------------------------------------- exact_match


class ExactMatchConfig(ExtractionConfig):
    strip: bool = True
    ignore_case: bool = False
    collapse_whitespace: bool = Field(default=True, description="Any run of whitespace compares as one space.")
    remove_punctuation: bool = False


class ExactMatchVerifier(BaseVerifier[ExactMatchConfig]):
    """Score 1 when the (extracted, normalised) answer equals one of the reference strings."""

    kind: ClassVar[str] = "exact_match"
    Config = ExactMatchConfig

    def _norm(self, text: str) -> str:
        c = self.config
        return normalize(
            text,
            strip=c.strip,
            ignore_case=c.ignore_case,
            collapse_whitespace=c.collapse_whitespace,
            remove_punctuation=c.remove_punctuation,
        )

    def _judge(self, inp: JudgeInput) -> Verdict:
        refs = [self._norm(r) for r in self.reference_answers(inp)]
        answer, why = _extract_or_none(self.config, inp.completion)
        if answer is None:
            return scored(0.0, self.config.pass_threshold, why, references=refs)
        got = self._norm(answer)
        ok = got in refs
        return scored(
            1.0 if ok else 0.0,
            self.config.pass_threshold,
            None if ok else "answer differs from the reference",
            answer=got[:500],
            references=refs,
        )


# ---------------------------------------------------------------- regex

_FLAG_NAMES = {"IGNORECASE": regex.IGNORECASE, "MULTILINE": regex.MULTILINE, "DOTALL": regex.DOTALL,
               "VERBOSE": regex.VERBOSE, "ASCII": regex.ASCII}


class RegexConfig(ExtractionConfig):
    pattern: str | None = Field(
        default=None, description="The pattern; when omitted each task's own 'pattern' field is used."
    )
    mode: Literal["full", "search"] = Field(default="full", description="fullmatch the answer, or search in it.")
    flags: list[Literal["IGNORECASE", "MULTILINE", "DOTALL", "VERBOSE", "ASCII"]] = Field(default_factory=list)
    strip: bool = Field(default=True, description="Strip surrounding whitespace from the answer first.")
    timeout_seconds: float = Field(default=1.0, gt=0, le=60, description="Regex engine time limit → invalid.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                regex.compile(value)
            except regex.error as exc:
                raise ValueError(f"does not compile: {exc}") from None
        return value


class RegexVerifier(BaseVerifier[RegexConfig]):
    """Score 1 when the pattern matches the (extracted) answer."""

    kind: ClassVar[str] = "regex"
    Config = RegexConfig

    def __init__(self, config: RegexConfig) -> None:
        super().__init__(config)
        self._flags = 0
        for name in config.flags:
            self._flags |= _FLAG_NAMES[name]
        self._compiled = regex.compile(config.pattern, self._flags) if config.pattern is not None else None

    def _judge(self, inp: JudgeInput) -> Verdict:
        if self._compiled is not None:
            compiled = self._compiled
        else:
            pattern = getattr(self.read_reference(inp), "pattern", None)
            if not pattern:
                raise InvalidReference("no pattern: set the verifier's 'pattern', or give each task a 'pattern'")
            try:
                compiled = regex.compile(pattern, self._flags)
            except regex.error as exc:
                raise InvalidReference(f"reference pattern does not compile: {exc}") from None
        answer, why = _extract_or_none(self.config, inp.completion)
        if answer is None:
            return scored(0.0, self.config.pass_threshold, why)
        if self.config.strip:
            answer = answer.strip()
        match_fn = compiled.fullmatch if self.config.mode == "full" else compiled.search
        try:
            m = match_fn(answer, timeout=self.config.timeout_seconds)
        except TimeoutError:
            return Verdict(None, "invalid", f"regex timed out after {self.config.timeout_seconds}s",
                           {"pattern": compiled.pattern[:500]})
        return scored(
            1.0 if m else 0.0,
            self.config.pass_threshold,
            None if m else "pattern did not match",
            matched=m.group(0)[:500] if m else None,
        )


# ---------------------------------------------------------------- f1

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def qa_tokens(text: str) -> list[str]:
    """SQuAD-style normalisation: lower case, no punctuation, no articles, whitespace tokens."""
    text = normalize(text, ignore_case=True, remove_punctuation=True)
    return _ARTICLES.sub(" ", text).split()


def token_f1(prediction: str, reference: str) -> tuple[float, float, float]:
    """(f1, precision, recall) over normalised tokens; both empty counts as a perfect match."""
    pred, ref = qa_tokens(prediction), qa_tokens(reference)
    if not pred or not ref:
        same = float(pred == ref)
        return same, same, same
    common = Counter(pred) & Counter(ref)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0, 0.0, 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall), precision, recall


class F1Config(ExtractionConfig):
    pass_threshold: float = Field(default=0.5, ge=0.0, le=1.0, description="Pass when the best F1 reaches this.")


class F1Verifier(BaseVerifier[F1Config]):
    """Score = best token F1 between the (extracted) answer and any reference answer."""

    kind: ClassVar[str] = "f1"
    Config = F1Config

    def _judge(self, inp: JudgeInput) -> Verdict:
        refs = self.reference_answers(inp)
        if not any(qa_tokens(r) for r in refs):
            raise InvalidReference("every reference answer is empty after normalisation")
        answer, why = _extract_or_none(self.config, inp.completion)
        if answer is None:
            return scored(0.0, self.config.pass_threshold, why)
        best = max(((*token_f1(answer, r), r) for r in refs), key=lambda t: t[0])
        f1, precision, recall, ref = best
        return scored(
            f1,
            self.config.pass_threshold,
            None if f1 >= self.config.pass_threshold else f"token F1 {f1:.3f} below {self.config.pass_threshold}",
            f1=round(f1, 4),
            precision=round(precision, 4),
            recall=round(recall, 4),
            best_reference=ref[:500],
        )
