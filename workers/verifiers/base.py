"""The verifier contract: inputs, verdicts, the kinds table and config validation.

A verifier turns one ``JudgeInput`` (prompt, completion, reference) into a ``Verdict``:

* ``pass`` / ``fail`` with a score in [0, 1] (``pass`` when ``score >= pass_threshold``), or
* ``invalid`` with a reason and ``score=None`` — the verifier could not judge (its own crash or timeout,
  a sandbox failure, an unparseable reference). Invalid verdicts are excluded from training and counted;
  they are never scored 0, because a 0 would teach the policy that a correct answer was wrong.

Kinds are chosen by name from ``KINDS`` (a literal name → dotted-path table, imported lazily so that
``math_verify``/``sympy`` are only imported by a process that asks for the ``math`` kind). Each kind
declares a pydantic ``Config``; ``build_verifier`` turns validation errors into ``VerifierConfigError``
with one "field: reason" line per problem.

What this module does NOT do: it does not isolate anything. Kinds that run model-written code
(``python_tests``, ``command``) or the user's own reward code (``python_reward``) delegate isolation to
``sandboxes``; the others run in-process on text and rely on size caps and (for regexes) engine
timeouts, not on process isolation.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workers.domains.kinds import Reference, ShapeError, domain_kinds_for, parse_reference

VerdictStatus = Literal["pass", "fail", "invalid"]
STATUSES: tuple[VerdictStatus, ...] = ("pass", "fail", "invalid")


@dataclass(frozen=True)
class JudgeInput:
    """One sample to judge. ``reference`` is what the task stores (``workers.domains.kinds``: the kind's
    reference model dumped), or a bare value standing for its main field. ``kind`` is the task's domain
    kind when known (the loop always knows it); without it the reference is read as the first kind the
    verifier judges that it fits."""

    prompt: str
    completion: str
    reference: Any = None
    kind: str | None = None


@dataclass(frozen=True)
class Verdict:
    """A verifier's judgment of one sample; JSON-serialisable through ``to_dict``.

    ``score`` is None exactly when ``status == "invalid"``.
    """

    score: float | None
    status: VerdictStatus
    reason: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if self.status == "invalid":
            if self.score is not None:
                raise ValueError("an invalid verdict has no score")
        else:
            if self.score is None or not math.isfinite(self.score) or not 0.0 <= self.score <= 1.0:
                raise ValueError(f"score must be a finite number in [0, 1], got {self.score!r}")

    @property
    def is_valid(self) -> bool:
        return self.status != "invalid"

    def with_latency(self, latency_ms: float) -> Verdict:
        return Verdict(self.score, self.status, self.reason, self.details, latency_ms)

    def to_dict(self) -> dict[str, Any]:
        return {
            "score": self.score,
            "status": self.status,
            "reason": self.reason,
            "details": jsonable(self.details),
            "latency_ms": round(self.latency_ms, 3),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Verdict:
        score = data.get("score")
        return cls(
            score=None if score is None else float(score),
            status=data["status"],
            reason=data.get("reason"),
            details=dict(data.get("details") or {}),
            latency_ms=float(data.get("latency_ms") or 0.0),
        )


def jsonable(value: Any, _depth: int = 0) -> Any:
    """A JSON-safe copy of ``value`` (details go into a JSON column): unknown objects become their repr."""
    if _depth > 20:
        return repr(value)[:200]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, Mapping):
        return {str(k): jsonable(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v, _depth + 1) for v in value]
    if isinstance(value, BaseModel):
        return jsonable(value.model_dump(mode="json"), _depth + 1)
    return repr(value)[:2000]


def scored(score: float, threshold: float, reason: str | None = None, **details: Any) -> Verdict:
    """A valid verdict: the score clamped to [0, 1], pass when it reaches the threshold."""
    score = min(1.0, max(0.0, float(score)))
    return Verdict(score, "pass" if score >= threshold else "fail", reason, details)


def invalid(reason: str, **details: Any) -> Verdict:
    return Verdict(None, "invalid", reason, details)


class VerifierConfigError(ValueError):
    """A verifier kind or configuration is wrong; ``str()`` holds one "field: reason" line per problem."""

    def __init__(self, kind: str, problems: list[str]) -> None:
        self.kind = kind
        self.problems = problems
        super().__init__(f"invalid {kind!r} verifier config:\n" + "\n".join(f"  {p}" for p in problems))


class InvalidReference(ValueError):
    """Raised inside a verifier when the reference cannot be used; the verdict becomes invalid."""


class VerifierConfig(BaseModel):
    """Fields every kind shares. Unknown keys are rejected so that typos surface at config time."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pass_threshold: float = Field(
        default=1.0, ge=0.0, le=1.0, description="A verdict passes when its score is at least this."
    )


@runtime_checkable
class Verifier(Protocol):
    @property
    def kind(self) -> str: ...

    def judge(self, inp: JudgeInput) -> Verdict: ...


ConfigT = TypeVar("ConfigT", bound=VerifierConfig)


class BaseVerifier(Generic[ConfigT]):
    """Shared plumbing: timing, and turning a verifier's own crash into an invalid verdict.

    Subclasses implement ``_judge`` and may raise ``InvalidReference``; any other exception is a bug or a
    resource failure of the verifier and also becomes ``invalid`` (never a score of 0).
    """

    kind: ClassVar[str] = ""
    Config: ClassVar[type[VerifierConfig]] = VerifierConfig

    def __init__(self, config: ConfigT) -> None:
        self.config = config

    def judge(self, inp: JudgeInput) -> Verdict:
        start = time.perf_counter()
        try:
            verdict = self._judge(inp)
        except InvalidReference as exc:
            verdict = invalid(f"unusable reference: {exc}")
        except RecursionError:
            verdict = invalid("verifier error: recursion limit reached")
        except MemoryError:
            verdict = invalid("verifier error: out of memory")
        except Exception as exc:
            verdict = invalid(f"verifier error: {type(exc).__name__}: {exc}"[:500])
        return verdict.with_latency((time.perf_counter() - start) * 1000.0)

    def _judge(self, inp: JudgeInput) -> Verdict:  # pragma: no cover - abstract
        raise NotImplementedError

    def judge_group(self, inputs: Sequence[JudgeInput]) -> list[Verdict]:
        """The verdicts of one group's samples, in order. One ``judge`` each here; a kind that can judge
        them together overrides it (``python_reward``: one sandbox execution per group)."""
        return [self.judge(inp) for inp in inputs]

    def read_reference(self, inp: JudgeInput) -> Reference:
        """The task's reference through its kind's model (``workers.domains.kinds``), the one the importer
        validated it with; a reference that does not fit raises ``InvalidReference`` saying what is wrong."""
        kinds = (inp.kind,) if inp.kind else domain_kinds_for(self.kind)
        try:
            return parse_reference(inp.reference, kinds)
        except ShapeError as exc:
            raise InvalidReference(str(exc)) from None

    def reference_answers(self, inp: JudgeInput) -> list[str]:
        """The acceptable answers of the task (``answer`` and ``document_qa`` kinds, an ``open`` task's answer)."""
        try:
            return self.read_reference(inp).answers()
        except InvalidReference:
            raise
        except ValueError as exc:
            raise InvalidReference(str(exc)) from None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.config.model_dump()}>"


# name → "module:Class"; imported lazily by build_verifier.
KINDS: dict[str, str] = {
    "exact_match": "workers.verifiers.text:ExactMatchVerifier",
    "regex": "workers.verifiers.text:RegexVerifier",
    "f1": "workers.verifiers.text:F1Verifier",
    "json_match": "workers.verifiers.json_match:JsonMatchVerifier",
    "math": "workers.verifiers.mathexpr:MathVerifier",
    "python_tests": "workers.verifiers.python_tests:PythonTestsVerifier",
    "command": "workers.verifiers.command:CommandVerifier",
    "llm_judge": "workers.verifiers.llm_judge:LLMJudgeVerifier",
    "generator": "workers.verifiers.generator:GeneratorVerifier",
    "python_reward": "workers.verifiers.python_reward:PythonRewardVerifier",
}


def judge_all(kind: str | None, config: Mapping[str, Any] | None, inputs: Sequence[JudgeInput]) -> list[Verdict]:
    """The verdicts of one group's samples by a verifier of ``kind`` (None: the domain has none), every
    failure an invalid verdict with the reason, never a score of 0 — a configuration that does not build
    included."""
    if kind is None:
        return [invalid("the domain has no verifier")] * len(inputs)
    started = time.perf_counter()
    try:
        return get_verifier(kind, config).judge_group(inputs)
    except Exception as exc:
        latency = (time.perf_counter() - started) * 1000 / max(1, len(inputs))
        return [invalid(f"verifier crashed: {type(exc).__name__}: {exc}").with_latency(latency)] * len(inputs)


def verifier_class(kind: str) -> type[BaseVerifier[Any]]:
    if kind not in KINDS:
        raise VerifierConfigError(kind, [f"kind: unknown verifier kind {kind!r}; known: {', '.join(KINDS)}"])
    module_name, _, attr = KINDS[kind].partition(":")
    cls: type[BaseVerifier[Any]] = getattr(importlib.import_module(module_name), attr)
    return cls


def format_validation_error(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(config)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{loc}: {msg}")
    return lines


def validate_config(kind: str, config: Mapping[str, Any] | None) -> VerifierConfig:
    """Validate ``config`` for ``kind``; raises ``VerifierConfigError`` with field-level lines."""
    cls = verifier_class(kind)
    if config is not None and not isinstance(config, Mapping):
        raise VerifierConfigError(kind, [f"(config): expected a JSON object, got {type(config).__name__}"])
    try:
        return cls.Config.model_validate(dict(config or {}))
    except ValidationError as exc:
        raise VerifierConfigError(kind, format_validation_error(exc)) from None


def normalized_config(kind: str, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The validated config with every default filled in, as JSON (what to store with a verifier)."""
    return validate_config(kind, config).model_dump(mode="json", by_alias=True)


def config_schema(kind: str) -> dict[str, Any]:
    """JSON Schema of a kind's config (field types, defaults and help texts) for forms and API docs."""
    return verifier_class(kind).Config.model_json_schema(by_alias=True)


def build_verifier(
    kind: str,
    config: Mapping[str, Any] | None = None,
    *,
    generate: Callable[[str], str] | None = None,
) -> BaseVerifier[Any]:
    """Build a verifier of ``kind`` from a JSON-like ``config``.

    ``generate`` is only used by ``llm_judge`` (the run's own engine as the judge); passing it to other
    kinds is an error, so a misconfigured domain is noticed.
    """
    cls = verifier_class(kind)
    cfg = validate_config(kind, config)
    if generate is not None:
        if kind != "llm_judge":
            raise VerifierConfigError(kind, ["generate: only the llm_judge kind takes a generate callable"])
        return cls(cfg, generate=generate)  # type: ignore[call-arg]
    try:
        return cls(cfg)
    except VerifierConfigError:
        raise
    except ValueError as exc:  # cross-field checks done at construction (e.g. a pattern that won't compile)
        raise VerifierConfigError(kind, [str(exc)]) from None


@functools.lru_cache(maxsize=256)
def _cached_verifier(kind: str, config_json: str) -> BaseVerifier[Any]:
    return build_verifier(kind, json.loads(config_json))


def get_verifier(kind: str, config: Mapping[str, Any] | None = None) -> BaseVerifier[Any]:
    """``build_verifier`` memoised per process by (kind, canonical JSON of config): for workers that judge
    many samples of few domains. Verifiers are stateless between judgments, so sharing one is safe."""
    return _cached_verifier(kind, json.dumps(config or {}, sort_keys=True, separators=(",", ":")))
