"""One definition per domain kind: the JSONL row, the stored reference, the verifiers that can judge it.

A task row is the fields every kind shares (``id``, ``prompt``, ``split``, ``metadata``) plus the fields
of its kind's **reference** model. The importer validates a row by splitting it in two and validating the
second half with the reference model; the task stores that model's dump; a verifier reads the stored
reference back through the same model (``parse_reference``). So a field the importer stores is, by
construction, the field the verifier reads — there is no second parser to drift.

Each kind also names the verifier kinds that can judge it (attaching another is refused at attach time),
the reference fields the model may be shown (``template_fields``: a document's context, a command task's
input files — never the answer or the tests), its default prompt template, and example rows; the example
files under ``assets/examples/`` and the README's table are generated from them
(``python -m workers.domains.kinds --write``), and a test holds them to it.

A bare value stands for the kind's main field where that is unambiguous (``"5"`` is ``{"answer": "5"}``
for ``answer``, a string is the ``tests`` of ``code``, the ``script`` of ``command``), so hand-written
calibration cases stay short. ``json`` has no shorthand: ``{"expected": ...}`` and ``{"schema": ...}``
mean different checks, and guessing between them is how a schema check turned into "any JSON passes".

Pure: pydantic and jsonschema; no Django.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import jsonschema
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

KindName = Literal["answer", "code", "command", "document_qa", "json", "open", "generated"]
COMMON_FIELDS = ("id", "prompt", "split", "metadata")


class ShapeError(ValueError):
    """A reference (or row) does not fit its kind; ``problems`` holds (field, reason) pairs."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{f}: {r}" for f, r in problems))


class Reference(BaseModel):
    """What a task of one kind stores besides its prompt: the facts its verifier judges against."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    shorthand: ClassVar[str | None] = None
    """The field a bare (non-object) value fills."""

    @model_validator(mode="before")
    @classmethod
    def _bare_value(cls, data: Any) -> Any:
        if cls.shorthand is not None and not isinstance(data, Mapping):
            return {cls.shorthand: data}
        return data

    def stored(self) -> dict[str, Any]:
        """The JSON stored in ``Task.reference``."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_defaults=False)

    def template_fields(self) -> dict[str, str]:
        """Reference fields the model may be shown through the prompt template (never the answer)."""
        return {}

    def answers(self) -> list[str]:
        """The acceptable answers, for the kinds that have them (text verifiers read these)."""
        raise ValueError(f"a {type(self).__name__.removesuffix('Reference').lower()} task has no answers")


def _strings(value: Any) -> Any:
    """Numbers are accepted where answers are strings (``"answer": 5``); lists keep their order."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, list):
        return [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]
    return value


class AnswerReference(Reference):
    shorthand = "answer"

    answer: str | list[str] | None = Field(
        None, description="The answer, or a list of acceptable answers (exact_match, math, f1, llm_judge)")
    pattern: str | None = Field(
        None, description="A regular expression the answer must match (regex, when its config has none)")

    @field_validator("answer", mode="before")
    @classmethod
    def _coerce(cls, value: Any) -> Any:
        return _strings(value)

    @model_validator(mode="after")
    def _something_to_judge(self) -> AnswerReference:
        if self.answer is None and self.pattern is None:
            raise ValueError("Field required (or a 'pattern', for a regex verifier)")
        if isinstance(self.answer, list) and not self.answer:
            raise ValueError("'answer' must not be an empty list")
        return self

    def answers(self) -> list[str]:
        if self.answer is None:
            raise ValueError("the task has no 'answer' (only a 'pattern')")
        return [self.answer] if isinstance(self.answer, str) else list(self.answer)


class DocumentQAReference(Reference):
    shorthand = "answers"

    answers_: list[str] = Field(alias="answers", min_length=1, description="Acceptable answers (token F1 takes the best)")
    context: str = Field("", description="The document; shown to the model through {context} in the prompt template")

    @field_validator("answers_", mode="before")
    @classmethod
    def _coerce(cls, value: Any) -> Any:
        value = _strings(value)
        return [value] if isinstance(value, str) else value

    def answers(self) -> list[str]:
        return list(self.answers_)

    def template_fields(self) -> dict[str, str]:
        return {"context": self.context}


class CodeReference(Reference):
    shorthand = "tests"

    tests: str = Field(min_length=1, validation_alias=AliasChoices("tests", "test"),
                       description="Assert-style Python test code run after the completion")
    entry_point: str | None = Field(None, description="The function under test (shown as {entry_point})")

    @field_validator("tests")
    @classmethod
    def _compiles(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("tests are empty")
        if problem := _compile_problem(value):
            raise ValueError(problem)
        return value

    def template_fields(self) -> dict[str, str]:
        return {"entry_point": self.entry_point or ""}


@functools.lru_cache(maxsize=1024)
def _compile_problem(tests: str) -> str | None:
    """Why test code does not compile (None when it does); cached: a task's tests are read G times a group."""
    try:
        compile(tests, "<tests>", "exec")
    except SyntaxError as exc:
        return f"tests do not compile: {exc.msg} (line {exc.lineno})"
    return None


def _safe_relpath(path: str) -> bool:
    parts = path.replace("\\", "/").split("/")
    return bool(path) and not path.startswith("/") and ".." not in parts and all(parts)


class CommandReference(Reference):
    shorthand = "script"

    script: str | None = Field(
        None, validation_alias=AliasChoices("script", "test_script"),
        description="Test script run after the completion; exit code 0 means pass (row field `script` or `test_script`)")
    files: dict[str, str] = Field(default_factory=dict,
                                  description="Input files placed in the work dir, read-only (shown as {files})")
    expected_files: dict[str, str] = Field(
        default_factory=dict, description="Files the completion must produce, compared outside the sandbox")
    interpreter: Literal["bash", "python"] | None = Field(None, description="Of the script; default: the verifier's")

    @field_validator("files", "expected_files")
    @classmethod
    def _relative(cls, value: dict[str, str]) -> dict[str, str]:
        bad = [k for k in value if not _safe_relpath(k)]
        if bad:
            raise ValueError(f"paths must be relative and stay inside the work dir: {bad[:3]}")
        return value

    @model_validator(mode="after")
    def _something_to_check(self) -> CommandReference:
        if not (self.script or "").strip() and not self.expected_files:
            raise ValueError("needs a 'script' and/or 'expected_files'")
        return self

    def template_fields(self) -> dict[str, str]:
        listing = "\n\n".join(f"--- {path}\n{content}" for path, content in sorted(self.files.items()))
        return {"files": listing}


_NOTHING = object()


class JsonReference(Reference):
    expected: Any = Field(None, description="The JSON value the completion must equal (equal / subset modes)")
    json_schema: dict[str, Any] | None = Field(
        None, alias="schema", description="A JSON Schema (draft 2020-12) the completion must satisfy (schema mode; "
                                          "shown as {schema})")

    @field_validator("json_schema")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                jsonschema.Draft202012Validator.check_schema(value)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"not a valid JSON Schema: {exc.message}") from None
        return value

    @model_validator(mode="after")
    def _something_to_check(self) -> JsonReference:
        if "expected" not in self.model_fields_set and self.json_schema is None:
            raise ValueError("needs 'expected' (a JSON value) and/or 'schema' (a JSON Schema)")
        return self

    @property
    def has_expected(self) -> bool:
        return "expected" in self.model_fields_set

    def stored(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.has_expected:
            out["expected"] = self.expected  # null is a legitimate expected value
        if self.json_schema is not None:
            out["schema"] = self.json_schema
        return out

    def template_fields(self) -> dict[str, str]:
        return {"schema": json.dumps(self.json_schema, sort_keys=True) if self.json_schema is not None else ""}


class OpenReference(Reference):
    shorthand = "answer"

    rubric: str = Field("", description="What a good response to this task must do (added to the judge's rubric)")
    answer: str = Field("", description="A reference answer shown to the judge (optional)")

    def answers(self) -> list[str]:
        if not self.answer:
            raise ValueError("the task has no reference 'answer'")
        return [self.answer]


class GeneratedReference(Reference):
    """A task made by a generator domain (``workers.domains.generators``): the generator's answer and what
    its own score reads besides it. Written by the generator, never by a person (though it imports)."""

    shorthand = None

    generator: str = Field(min_length=1, description="The generator that made the task (demo.addition, rg.<dataset>)")
    answer: str = Field(description="The generator's answer")
    entry: dict[str, Any] = Field(default_factory=dict, description="What the generator's score reads besides the answer")

    @field_validator("answer", mode="before")
    @classmethod
    def _coerce(cls, value: Any) -> Any:
        return _strings(value)

    def answers(self) -> list[str]:
        return [self.answer]


@dataclass(frozen=True)
class KindSpec:
    name: KindName
    label: str
    reference: type[Reference]
    verifiers: tuple[str, ...]
    """Verifier kinds that can judge this kind's tasks (the first is the usual one)."""
    default_template: str
    examples: tuple[dict[str, Any], ...] = field(default_factory=tuple)


KINDS: dict[str, KindSpec] = {
    "answer": KindSpec(
        "answer", "prompt → short answer (exact match, math, regex)", AnswerReference,
        ("exact_match", "math", "regex", "f1", "llm_judge", "python_reward"), "{prompt}",
        ({"id": "add-1", "prompt": "2+3=", "answer": "5"},
         {"id": "half", "prompt": "What is 1/2 as a decimal?", "answer": ["0.5", ".5"], "split": "heldout"},
         {"id": "year", "prompt": "Name a year of the 1990s.", "pattern": "199[0-9]"})),
    "code": KindSpec(
        "code", "prompt → Python code checked by unit tests", CodeReference,
        ("python_tests", "python_reward"), "{prompt}",
        ({"id": "square", "prompt": "Write square(x) returning x squared.", "tests": "assert square(3) == 9",
          "entry_point": "square"},
         {"id": "rev", "prompt": "def rev(s):\n    \"\"\"Reverse a string.\"\"\"\n",
          "tests": "assert rev('ab') == 'ba'\nassert rev('') == ''", "entry_point": "rev"})),
    "command": KindSpec(
        "command", "prompt → files or a shell session checked by a test script", CommandReference,
        ("command", "python_reward"),
        "{prompt}\n\n{files}",
        ({"id": "count", "prompt": "Write the number of lines of input.txt to count.txt.",
          "files": {"input.txt": "a\nb\nc\n"}, "script": "test \"$(cat count.txt)\" = 3"},
         {"id": "hello", "prompt": "Create hello.txt containing hello.", "expected_files": {"hello.txt": "hello"}})),
    "document_qa": KindSpec(
        "document_qa", "document + question → answer (token F1)", DocumentQAReference,
        ("f1", "exact_match", "llm_judge", "python_reward"),
        "{context}\n\nQuestion: {prompt}\nAnswer:",
        ({"id": "capital", "prompt": "What is the capital of France?",
          "context": "France is a country in Europe. Its capital is Paris.", "answers": ["Paris"]},)),
    "json": KindSpec(
        "json", "prompt → JSON document (equal, subset or schema)", JsonReference,
        ("json_match", "python_reward"), "{prompt}",
        ({"id": "point", "prompt": "The point (1, 2) as JSON with keys x and y.", "expected": {"x": 1, "y": 2}},
         {"id": "person", "prompt": "A person as JSON with a name and a non-negative age.",
          "schema": {"type": "object", "required": ["name", "age"],
                     "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}}}})),
    "open": KindSpec(
        "open", "prompt → free text (LLM judge with a rubric)", OpenReference,
        ("llm_judge", "python_reward"), "{prompt}",
        ({"id": "haiku", "prompt": "Write a haiku about the sea.", "rubric": "Three lines of 5, 7 and 5 syllables."},)),
    "generated": KindSpec(
        "generated", "made by a seeded generator, scored by the generator's own score", GeneratedReference,
        ("generator", "exact_match", "math"), "{prompt}",
        ({"id": "train-0", "prompt": "37+48=", "generator": "demo.addition", "answer": "85",
          "entry": {"a": 37, "b": 48, "difficulty": 2}},)),
}


def kind_spec(kind: str) -> KindSpec:
    try:
        return KINDS[kind]
    except KeyError:
        raise ShapeError([("kind", f"unknown domain kind {kind!r}; known: {', '.join(KINDS)}")]) from None


def domain_kinds_for(verifier_kind: str) -> tuple[str, ...]:
    """The domain kinds a verifier kind can judge, in the order of ``KINDS``."""
    return tuple(name for name, spec in KINDS.items() if verifier_kind in spec.verifiers)


def attach_problem(verifier_kind: str, domain_kind: str) -> str | None:
    """Why a verifier of ``verifier_kind`` cannot judge a domain of ``domain_kind`` (None when it can)."""
    spec = kind_spec(domain_kind)
    if verifier_kind in spec.verifiers:
        return None
    return (f"a {verifier_kind} verifier cannot judge a {domain_kind!r} domain (its tasks store "
            f"{_fields(spec.reference)}); use one of: {', '.join(spec.verifiers)}")


def _fields(model: type[BaseModel]) -> str:
    return ", ".join(f.alias or name for name, f in model.model_fields.items())


def _problems(exc: ValidationError, model: type[BaseModel] | None = None) -> list[tuple[str, str]]:
    """(field, reason) pairs; a whole-model check is reported on the model's main field when it has one."""
    main = getattr(model, "shorthand", None) or "(row)"
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if p not in ("function-after", "function-before"))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        out.append((loc or main, msg))
    return out


def validate_reference(kind: str, raw: Any) -> Reference:
    """``raw`` read as a reference of ``kind``; raises ``ShapeError`` with (field, reason) pairs."""
    spec = kind_spec(kind)
    try:
        return spec.reference.model_validate(raw)
    except ValidationError as exc:
        raise ShapeError(_problems(exc, spec.reference)) from None


def parse_reference(raw: Any, kinds: Sequence[str]) -> Reference:
    """A stored reference read as the first of ``kinds`` it fits (a verifier passes the kinds it judges;
    the loop passes the task's own kind). Raises ``ShapeError`` naming what each kind lacked."""
    failures: list[tuple[str, str]] = []
    for kind in kinds:
        try:
            return validate_reference(kind, raw)
        except ShapeError as exc:
            failures += [(f"{kind}: {f}", r) for f, r in exc.problems]
    if len(kinds) == 1:
        failures = [(f.split(": ", 1)[1], r) for f, r in failures]
    raise ShapeError(failures or [("(reference)", "no domain kind given")])


@dataclass(frozen=True)
class ParsedRow:
    id: str | None
    prompt: str
    split: Literal["train", "heldout"] | None
    metadata: dict[str, Any]
    reference: Reference


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str | int | None = Field(None, description="Your identifier for the task, unique in the domain")
    prompt: str = Field(min_length=1, description="The task as the model sees it through {prompt}")
    split: Literal["train", "heldout"] | None = Field(None, description="Default: by the domain's held-out fraction")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Anything; shown as {metadata.<key>}")


def parse_row(kind: str, data: Mapping[str, Any]) -> ParsedRow:
    """One JSONL row of a ``kind`` domain; raises ``ShapeError`` with every (field, reason)."""
    spec = kind_spec(kind)
    problems: list[tuple[str, str]] = []
    common: _Common | None = None
    try:
        common = _Common.model_validate(data)
    except ValidationError as exc:
        problems += _problems(exc)
    rest = {k: v for k, v in data.items() if k not in COMMON_FIELDS}
    reference: Reference | None = None
    try:
        reference = spec.reference.model_validate(rest)
    except ValidationError as exc:
        problems += [(f, r + (f" (a {kind} row has: {row_fields(kind)})" if r == "unknown field" else ""))
                     for f, r in _problems(exc, spec.reference)]
    if problems or common is None or reference is None:
        raise ShapeError(problems)
    return ParsedRow(None if common.id is None else str(common.id), common.prompt, common.split,
                     dict(common.metadata), reference)


def row_fields(kind: str) -> str:
    return ", ".join([*COMMON_FIELDS, *(f.alias or n for n, f in kind_spec(kind).reference.model_fields.items())])


# ---------------------------------------------------------------- generated documentation

README_START = "<!-- domain-kinds:start (generated by `python -m workers.domains.kinds --write`) -->"
README_END = "<!-- domain-kinds:end -->"


def example_jsonl(kind: str) -> str:
    return "".join(json.dumps(row, sort_keys=False) + "\n" for row in kind_spec(kind).examples)


def readme_table() -> str:
    lines = [README_START, "", "| kind | what | row fields (besides `id`, `prompt`, `split`, `metadata`) | verifiers | "
             "default prompt template | example |", "|---|---|---|---|---|---|"]
    for name, spec in KINDS.items():
        fields = []
        for fname, f in spec.reference.model_fields.items():
            required = f.is_required()
            fields.append(f"`{f.alias or fname}`" + ("" if required else "?"))
        template = spec.default_template.replace("\n", "⏎")
        lines.append(f"| `{name}` | {spec.label} | {', '.join(fields)} | {', '.join(f'`{v}`' for v in spec.verifiers)} "
                     f"| `{template}` | [`{name}.jsonl`](assets/examples/{name}.jsonl) |")
    lines += ["", "A `?` marks an optional field. Each example row imports as it is; the verifier reads exactly "
              "what the importer stores.", "", README_END]
    return "\n".join(lines)


def _check_examples() -> None:
    for name, spec in KINDS.items():
        for row in spec.examples:
            parse_row(name, row)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description="Write (or check) the example JSONL files and the README's kinds table.")
    parser.add_argument("--write", action="store_true", help="write assets/examples/*.jsonl and the README table")
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[2]))
    args = parser.parse_args(argv)
    root = Path(args.root)
    _check_examples()
    stale = []
    for name in KINDS:
        path = root / "assets" / "examples" / f"{name}.jsonl"
        if not path.exists() or path.read_text() != example_jsonl(name):
            stale.append(str(path))
            if args.write:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(example_jsonl(name))
    readme = root / "README.md"
    text = readme.read_text()
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < 0:
        raise SystemExit(f"{readme} has no {README_START!r} … {README_END!r} markers")
    current = text[start:end + len(README_END)]
    if current != readme_table():
        stale.append(str(readme))
        if args.write:
            readme.write_text(text[:start] + readme_table() + text[end + len(README_END):])
    if stale and not args.write:
        print("out of date (run `python -m workers.domains.kinds --write`):\n  " + "\n  ".join(stale))
        return 1
    print("written: " + ", ".join(stale) if stale else "up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
