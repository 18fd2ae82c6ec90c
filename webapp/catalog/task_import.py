"""Streaming, atomic import of tasks from JSONL, validated row by row against the domain's kind.

A row's shape is defined once, in ``workers.domains.kinds``: the reference it stores there is what the
domain's verifier reads back, through the same model.

A file with any bad row imports nothing; the answer lists every bad row with its line number, field and
reason. Good rows are written in batches inside one transaction while the file streams, so a 100,000-row
file never sits in memory as model objects and a bad row near the end still rolls everything back.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from django.db import transaction
from django.db.models import F

from webapp.catalog.models import Task, TaskDomain
from webapp.common.errors import ValidationFailed
from workers.domains.kinds import ParsedRow, ShapeError, parse_row

BATCH_SIZE = 2000
MAX_LISTED_ERRORS = 1000


@dataclass
class ImportRowError:
    line: int
    field: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "field": self.field, "reason": self.reason}


@dataclass
class ImportResult:
    imported: int = 0
    heldout: int = 0
    rows: int = 0
    errors: list[ImportRowError] = field(default_factory=list)
    error_count: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "imported": self.imported,
            "heldout": self.heldout,
            "rows": self.rows,
            "error_count": self.error_count,
            "errors": [e.to_dict() for e in self.errors],
        }


class ImportFailed(ValidationFailed):
    """Raised when any row is bad; nothing was imported. ``result`` lists the bad rows."""

    def __init__(self, result: ImportResult) -> None:
        shown = len(result.errors)
        more = f" (first {shown} listed)" if result.error_count > shown else ""
        super().__init__(
            f"{result.error_count} bad row(s) of {result.rows}{more}; nothing was imported",
            details=result.to_dict(),
        )
        self.result = result


def _lines(source: Iterable[bytes | str]) -> Iterator[tuple[int, str | None]]:
    """(line number, text) per line; text is None where the bytes are not UTF-8."""
    for number, raw in enumerate(source, start=1):
        if isinstance(raw, bytes):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError:
                yield number, None
        else:
            yield number, raw


def _is_heldout(key: str, fraction: float) -> bool:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def _parse(line_no: int, text: str, kind: str) -> tuple[ParsedRow | None, list[ImportRowError]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, [ImportRowError(line_no, "(line)", f"not valid JSON: {exc.msg} at column {exc.colno}")]
    if not isinstance(data, dict):
        return None, [ImportRowError(line_no, "(line)", f"expected a JSON object, got {type(data).__name__}")]
    try:
        return parse_row(kind, data), []
    except ShapeError as exc:
        return None, [ImportRowError(line_no, f or "(row)", r) for f, r in exc.problems]


def import_tasks(
    domain: TaskDomain,
    source: Iterable[bytes | str],
    *,
    progress: Callable[[int], None] | None = None,
) -> ImportResult:
    """Validate and import every row of a JSONL stream into ``domain``, all or nothing.

    Raises ``ImportFailed`` listing each bad row (line number, field, reason) when any row is bad.
    ``progress`` is called with the number of lines read so far, every batch.
    """
    result = ImportResult()
    existing_ids = set(
        domain.tasks.exclude(external_id__isnull=True).values_list("external_id", flat=True).iterator()
    )
    seen_ids: dict[str, int] = {}
    batch: list[Task] = []

    def error(err: ImportRowError) -> None:
        result.error_count += 1
        if len(result.errors) < MAX_LISTED_ERRORS:
            result.errors.append(err)

    def flush() -> None:
        if batch and not result.error_count:
            Task.objects.bulk_create(batch, batch_size=BATCH_SIZE)
        batch.clear()

    with transaction.atomic():
        for line_no, text in _lines(source):
            if text is None:
                result.rows += 1
                error(ImportRowError(line_no, "(line)", "not UTF-8 text"))
                continue
            if not text.strip():
                continue
            result.rows += 1
            row, errors = _parse(line_no, text, domain.kind)
            for err in errors:
                error(err)
            if row is None:
                continue
            external_id = None if row.id is None else str(row.id)
            if external_id is not None:
                if external_id in existing_ids:
                    error(ImportRowError(line_no, "id", f"a task with id {external_id!r} already exists in this domain"))
                    continue
                if external_id in seen_ids:
                    error(ImportRowError(line_no, "id", f"duplicate id {external_id!r} (first on line {seen_ids[external_id]})"))
                    continue
                seen_ids[external_id] = line_no
            split = row.split or (
                Task.Split.HELDOUT
                if _is_heldout(external_id or row.prompt, domain.heldout_fraction)
                else Task.Split.TRAIN
            )
            result.heldout += split == Task.Split.HELDOUT
            batch.append(
                Task(
                    domain=domain, external_id=external_id, prompt=row.prompt, reference=row.reference.stored(),
                    metadata=row.metadata, split=split,
                )
            )
            if len(batch) >= BATCH_SIZE:
                flush()
                if progress:
                    progress(line_no)
        flush()
        if result.rows == 0:
            error(ImportRowError(0, "(file)", "the file holds no rows"))
        if result.error_count:
            result.heldout = 0
            raise ImportFailed(result)  # leaving the atomic block by an exception rolls back every batch
        result.imported = result.rows
        TaskDomain.objects.filter(pk=domain.pk).update(
            task_count=F("task_count") + result.imported, heldout_count=F("heldout_count") + result.heldout
        )
    domain.refresh_from_db(fields=["task_count", "heldout_count"])
    return result
