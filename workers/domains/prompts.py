"""What the model sees: a domain's prompt template rendered with a task's visible fields.

A template is text with ``{field}`` placeholders (``{{`` and ``}}`` are literal braces). The fields are
the task's ``prompt``, the reference fields its kind lets the model see (``kinds.Reference.template_fields``:
``{context}`` for document QA, ``{files}`` for command tasks, ``{entry_point}``, ``{schema}``) and
``{metadata.<key>}``. The answer, the tests and the expected files are never fields: a template cannot leak
them. A template that names anything else is refused when it is saved (``check_template``), with the list
of fields it may use. The empty template means the kind's default (``{prompt}`` for ``answer``: today's
behaviour; the document then the question for ``document_qa``).

A domain's system prompt goes first, followed by a blank line. (Rendering it as a chat model's system
message is the chat-template path's job, where a base model has a template.)

Pure: no Django.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from typing import Any

from workers.domains.kinds import kind_spec, validate_reference

_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_NAME = re.compile(r"^(?:[a-z_][a-z0-9_]*|metadata\.[A-Za-z0-9_\-]+)$")


class TemplateError(ValueError):
    """A template that cannot be rendered; ``str()`` says which placeholder and what is allowed."""


def placeholders(template: str) -> list[str]:
    """The field names a template uses, in order; raises ``TemplateError`` on a stray brace."""
    names = []
    for m in _TOKEN.finditer(template):
        text = m.group(0)
        if text in ("{{", "}}"):
            continue
        if m.group(1) is None:
            raise TemplateError(f"stray {text!r} at character {m.start() + 1}: write a literal brace as {text * 2}")
        name = m.group(1).strip()
        if not _NAME.match(name):
            raise TemplateError(f"{{{m.group(1)}}} is not a field name (fields look like {{prompt}} or "
                                "{metadata.key}; no attributes, indexes or format specs)")
        names.append(name)
    return names


def allowed_fields(kind: str) -> list[str]:
    """The fields a template of a ``kind`` domain may name (besides ``metadata.<key>``)."""
    spec = kind_spec(kind)
    example = spec.examples[0] if spec.examples else {}
    reference = validate_reference(kind, {k: v for k, v in example.items()
                                          if k not in ("id", "prompt", "split", "metadata")})
    return ["prompt", *reference.template_fields()]


def check_template(kind: str, template: str) -> list[str]:
    """Problems of a template for a ``kind`` domain (empty when it is fine). The empty template is fine."""
    if not template:
        return []
    try:
        names = placeholders(template)
    except TemplateError as exc:
        return [str(exc)]
    allowed = allowed_fields(kind)
    problems = [f"{{{name}}} is not a field of a {kind} task; use {', '.join('{' + a + '}' for a in allowed)} "
                "or {metadata.<key>}" for name in dict.fromkeys(names)
                if name not in allowed and not name.startswith("metadata.")]
    if "prompt" not in names and not problems:
        problems.append("the template never shows the task: it needs {prompt}")
    return problems


def render(kind: str, template: str, system: str, *, prompt: str, reference: Any,
           metadata: Mapping[str, Any] | None = None) -> str:
    """The text the model is given for one task. ``reference`` is the stored reference (its visible fields
    are read through the kind's model); a metadata key the task lacks renders as nothing."""
    template = template or kind_spec(kind).default_template
    values: dict[str, str] = {"prompt": prompt}
    if template == "{prompt}":  # the common case, and the demo's hot path: nothing else to read
        return f"{system}\n\n{prompt}" if system else prompt
    # a reference that does not fit is the verifier's to report (invalid), not the prompt's
    with contextlib.suppress(ValueError):
        values.update(validate_reference(kind, reference).template_fields())
    meta = metadata or {}

    def field(m: re.Match[str]) -> str:
        text = m.group(0)
        if text == "{{":
            return "{"
        if text == "}}":
            return "}"
        if m.group(1) is None:
            raise TemplateError(f"stray {text!r} in the template")
        name = m.group(1).strip()
        if name.startswith("metadata."):
            value = meta.get(name.removeprefix("metadata."), "")
            return value if isinstance(value, str) else str(value)
        if name not in values:
            raise TemplateError(f"{{{name}}} is not a field of a {kind} task")
        return values[name]

    body = _TOKEN.sub(field, template).rstrip("\n")  # an empty last field leaves no blank tail
    return f"{system}\n\n{body}" if system else body
