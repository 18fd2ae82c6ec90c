"""``json_match``: the completion's JSON compared with the reference — equality, subset, or JSON Schema.

The JSON is taken from the whole completion, else from the last fenced block (```json ... ```), else from
the last decodable object/array in the text (``extract="auto"``). A completion with no decodable JSON
fails. The task's reference is a ``json`` kind reference (``workers.domains.kinds.JsonReference``):
``{"expected": value}`` and/or ``{"schema": {...}}``. Equality is type-aware: ``true`` never equals ``1``;
``1`` equals ``1.0``; floats may be compared with an absolute tolerance. ``subset``: every key of the
expected object must be present with a subset-matching value (lists compare element-wise, same length);
extra keys in the completion are allowed. ``schema``: the completion must satisfy the task's schema and/or
``config.schema`` (draft 2020-12); every schema that applies is checked in every mode. A mode that lacks
what it compares with (``equal`` without ``expected``, ``schema`` without any schema) makes the verdict
invalid — never a pass.

What it does NOT catch: ``subset`` accepts any extra keys, including ones that contradict the intent;
``schema`` checks shape, not truth (a schema-valid object full of wrong values passes). Duplicate keys in
the completion's object are resolved the way ``json.loads`` does (the last one wins). Remote ``$ref``s
in schemas are not fetched (the verdict becomes invalid). ``format`` keywords are annotations only (not
asserted). A schema ``pattern`` runs on Python's ``re`` without a time limit: a backtracking-prone
pattern can stall on a hostile string — keep schema patterns linear (the worker's task time limit is the
backstop, and its exception becomes an invalid verdict).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, ClassVar, Literal

import jsonschema
from pydantic import Field, field_validator

from workers.domains.kinds import JsonReference
from workers.verifiers.base import BaseVerifier, InvalidReference, JudgeInput, Verdict, VerifierConfig, scored

_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n(.*?)```", re.DOTALL)


class JsonMatchConfig(VerifierConfig):
    mode: Literal["equal", "subset", "schema"] = "equal"
    extract: Literal["whole", "auto"] = Field(
        default="auto", description="whole: the completion must be JSON; auto: also fenced blocks / embedded JSON."
    )
    float_tolerance: float = Field(default=0.0, ge=0.0, description="Absolute tolerance when comparing numbers.")
    schema_: dict[str, Any] | None = Field(
        default=None,
        alias="schema",
        description="A fixed JSON Schema checked in every mode (mode='schema' uses the reference if unset).",
    )
    max_completion_chars: int = Field(default=200_000, gt=0)

    @field_validator("schema_")
    @classmethod
    def _check_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                jsonschema.Draft202012Validator.check_schema(value)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
        return value


_MISSING = object()


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _MISSING


def extract_json(text: str, mode: Literal["whole", "auto"] = "auto") -> Any:
    """The JSON value in ``text`` or ``_MISSING``."""
    value = _loads(text.strip())
    if value is not _MISSING or mode == "whole":
        return value
    for block in reversed(_FENCE.findall(text)):
        value = _loads(block.strip())
        if value is not _MISSING:
            return value
    decoder = json.JSONDecoder()
    found: Any = _MISSING
    i = 0
    attempts = 0
    # Left to right, keep the last decodable object/array; skip past each decoded one. Failed attempts
    # are capped (and a run of opening brackets is skipped at once): "[[[[…" must not cost O(n · depth).
    while i < len(text) and attempts < 256:
        attempts += 1
        j = min((k for k in (text.find("{", i), text.find("[", i)) if k >= 0), default=-1)
        if j < 0:
            break
        try:
            found, end = decoder.raw_decode(text, j)
            i = end
        except (ValueError, RecursionError):
            i = j + 1
            while i < len(text) and text[i] in "[{":
                i += 1
    return found


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def json_equal(a: Any, b: Any, tol: float = 0.0) -> bool:
    if _is_number(a) and _is_number(b):
        if isinstance(a, float) and math.isnan(a):
            return False
        return bool(a == b or (tol > 0 and abs(a - b) <= tol))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k], tol) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(json_equal(x, y, tol) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def json_subset(expected: Any, got: Any, tol: float = 0.0) -> bool:
    """Every key of ``expected`` (recursively) is in ``got`` with a matching value."""
    if isinstance(expected, dict):
        return isinstance(got, dict) and all(k in got and json_subset(v, got[k], tol) for k, v in expected.items())
    if isinstance(expected, list):
        return (
            isinstance(got, list)
            and len(expected) == len(got)
            and all(json_subset(x, y, tol) for x, y in zip(expected, got, strict=True))
        )
    return json_equal(expected, got, tol)


def _schema_errors(schema: dict[str, Any], value: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"[:300] for e in errors[:10]]


class JsonMatchVerifier(BaseVerifier[JsonMatchConfig]):
    kind: ClassVar[str] = "json_match"
    Config = JsonMatchConfig

    def _judge(self, inp: JudgeInput) -> Verdict:
        c = self.config
        thr = c.pass_threshold
        ref = self.read_reference(inp)
        assert isinstance(ref, JsonReference)
        # Every schema that applies is checked: the verifier's own and the task's. A mode that needs
        # something the task lacks is invalid, never a pass: an empty check would reward any JSON.
        schemas = [s for s in (c.schema_, ref.json_schema) if s is not None]
        if c.mode == "schema" and not schemas:
            raise InvalidReference("mode=schema needs a schema: the verifier's 'schema' or the task's 'schema'")
        if c.mode in ("equal", "subset") and not ref.has_expected:
            raise InvalidReference(f"mode={c.mode} compares with the task's 'expected' value, which it lacks")
        expected = ref.expected
        if len(inp.completion) > c.max_completion_chars:
            return scored(0.0, thr, f"completion longer than {c.max_completion_chars} characters")
        got = extract_json(inp.completion, c.extract)
        if got is _MISSING:
            return scored(0.0, thr, "no JSON found in the completion")
        details: dict[str, Any] = {"parsed": got}
        for schema in schemas:
            try:
                errors = _schema_errors(schema, got)
            except jsonschema.exceptions.RefResolutionError as exc:  # pragma: no cover - depends on schema
                raise InvalidReference(f"schema reference cannot be resolved: {exc}") from None
            if errors:
                return scored(0.0, thr, "JSON does not satisfy the schema", schema_errors=errors, **details)
        if c.mode == "equal" and not json_equal(expected, got, c.float_tolerance):
            return scored(0.0, thr, "JSON differs from the reference", **details)
        if c.mode == "subset" and not json_subset(expected, got, c.float_tolerance):
            return scored(0.0, thr, "JSON lacks or changes reference fields", **details)
        return scored(1.0, thr, None, **details)
