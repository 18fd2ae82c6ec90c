"""json_match: equality, subset, JSON Schema, extraction and hostile JSON."""

from __future__ import annotations

import pytest

from workers.verifiers.base import JudgeInput, VerifierConfigError, build_verifier
from workers.verifiers.json_match import _MISSING, extract_json, json_equal, json_subset


def judge(config: dict, completion: str, reference: object) -> tuple[str, str | None]:
    """``reference`` is what a json task stores: ``{"expected": …}`` and/or ``{"schema": …}``."""
    v = build_verifier("json_match", config).judge(JudgeInput("q", completion, reference))
    return v.status, v.reason


def expected(value: object) -> dict:
    return {"expected": value}


def test_extract_json_from_prose_and_fences() -> None:
    assert extract_json('{"a": 1}') == {"a": 1}
    assert extract_json('Sure!\n```json\n{"a": 2}\n```\nDone.') == {"a": 2}
    assert extract_json('first {"a": 1} then the final {"a": 3}.') == {"a": 3}
    assert extract_json("no json here {") is _MISSING
    assert extract_json('prose {"a": 1}', "whole") is _MISSING


def test_equality_is_type_aware() -> None:
    assert json_equal({"a": [1, 2.0]}, {"a": [1.0, 2]})
    assert not json_equal(True, 1)
    assert not json_equal(1, "1")
    assert not json_equal([1, 2], [2, 1])
    assert not json_equal(float("nan"), float("nan"))
    assert json_equal(0.1 + 0.2, 0.3, tol=1e-9)


def test_subset() -> None:
    assert json_subset({"a": 1, "b": {"c": [1, {"d": 2}]}}, {"a": 1, "x": 0, "b": {"c": [1, {"d": 2, "e": 3}]}})
    assert not json_subset({"a": 1}, {"a": 2})
    assert not json_subset({"a": 1}, [1])
    assert not json_subset({"l": [1, 2]}, {"l": [1, 2, 3]})


def test_equal_mode() -> None:
    ref = expected({"name": "Ada", "born": 1815, "langs": ["en", "fr"]})
    assert judge({}, '```json\n{"langs": ["en", "fr"], "born": 1815, "name": "Ada"}\n```', ref)[0] == "pass"
    assert judge({}, '{"name": "Ada", "born": "1815", "langs": ["en", "fr"]}', ref)[0] == "fail"
    assert judge({}, '{"name": "Ada", "born": 1815, "langs": ["en", "fr"], "extra": 1}', ref)[0] == "fail"
    assert judge({}, "[1, 2]", expected([1, 2]))[0] == "pass"
    assert judge({}, "null", expected(None))[0] == "pass"  # null is a value a task may expect
    assert judge({}, "0", expected(None))[0] == "fail"


def test_subset_mode() -> None:
    ref = expected({"city": "Paris"})
    assert judge({"mode": "subset"}, '{"city": "Paris", "country": "France"}', ref)[0] == "pass"
    assert judge({"mode": "subset"}, '{"country": "France"}', ref)[0] == "fail"


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_schema_mode_with_reference_schema() -> None:
    ref = {"schema": SCHEMA}
    assert judge({"mode": "schema"}, '{"name": "Bo", "age": 3}', ref)[0] == "pass"
    v = build_verifier("json_match", {"mode": "schema"}).judge(JudgeInput("q", '{"name": "Bo", "age": -1}', ref))
    assert v.status == "fail" and v.details["schema_errors"] == ["age: -1 is less than the minimum of 0"]
    assert judge({"mode": "schema"}, '{"name": "Bo", "age": 3, "x": 1}', ref)[0] == "fail"
    # the reward hack the old reading of the reference allowed: any JSON passed a task with a schema
    for hack in ("{}", "[]", "1", '{"expected": null, "schema": {}}'):
        assert judge({"mode": "schema"}, hack, ref)[0] == "fail", hack


def test_schema_mode_without_any_schema_is_invalid_never_a_pass() -> None:
    status, reason = judge({"mode": "schema"}, '{"x": 1}', expected({"x": 1}))
    assert status == "invalid" and "needs a schema" in (reason or "")


def test_equal_mode_without_expected_is_invalid() -> None:
    status, reason = judge({}, '{"name": "Bo", "age": 3}', {"schema": SCHEMA})
    assert status == "invalid" and "'expected'" in (reason or "")


def test_a_task_schema_applies_in_equal_mode_too() -> None:
    ref = {"expected": {"name": "Bo", "age": 3}, "schema": SCHEMA}
    assert judge({}, '{"name": "Bo", "age": 3}', ref)[0] == "pass"
    assert judge({}, '{"name": "Bo", "age": 4}', ref)[0] == "fail"


def test_schema_in_config_applies_with_equality() -> None:
    cfg = {"schema": {"type": "object", "required": ["id"]}}
    assert judge(cfg, '{"id": 1}', expected({"id": 1}))[0] == "pass"
    assert judge(cfg, "[1]", expected([1]))[0] == "fail"


def test_bad_schema_in_config_is_a_config_error() -> None:
    with pytest.raises(VerifierConfigError, match=r"schema: .*not a valid JSON Schema"):
        build_verifier("json_match", {"schema": {"type": "no-such-type"}})


def test_unusable_references_are_invalid() -> None:
    assert judge({"mode": "schema"}, "{}", {"schema": {"type": 12}})[0] == "invalid"
    assert judge({"mode": "schema"}, "{}", "not json")[0] == "invalid"
    assert judge({}, "{}", None)[0] == "invalid"
    assert judge({}, "{}", {})[0] == "invalid"
    assert judge({}, '{"a": 1}', {"a": 1})[0] == "invalid"  # a bare value is not a json reference: say so


@pytest.mark.parametrize(
    "completion",
    [
        "[" * 100_000 + "]" * 100_000,  # deeper than json's recursion limit
        '{"a": ' + "9" * 5000 + "}",  # an int beyond Python's digit limit
        "\x00\x01 {broken",
        "",
        '{"a": NaN}',
    ],
)
def test_hostile_json_fails_without_crashing(completion: str) -> None:
    status, _ = judge({"max_completion_chars": 1_000_000}, completion, expected({"a": 1}))
    assert status == "fail"


def test_duplicate_keys_last_wins() -> None:
    assert judge({}, '{"a": 2, "a": 1}', expected({"a": 1}))[0] == "pass"
