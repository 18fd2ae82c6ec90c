"""Bulk writes for the loop's hot path, without a model object per row.

``bulk_create`` builds a model instance per row (``Model.__init__`` walks every field and computes every
default) before it writes: for a rollout's 128 trajectories that was a few percent of the GPU worker's time,
spent holding the GIL its device thread needs (``bench/demo.py``). ``insert_ignoring_conflicts`` writes the
same rows with one prepared ``INSERT … ON CONFLICT DO NOTHING`` run for each (``executemany``), each value
prepared by its field exactly as the ORM prepares it (``get_db_prep_save``: JSON, datetimes, booleans), and
the fields a row does not give take their defaults, ``auto_now``/``auto_now_add`` the current time. SQLite
(3.24+) and PostgreSQL both take the statement.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from django.db import connection, models
from django.utils import timezone

# Fields that store a value of exactly this Python type as it is (their get_db_prep_save returns it
# unchanged); subclasses that convert (an email or IP address field) are not among them.
_AS_IS: dict[type[models.Field], type] = {models.BooleanField: bool, models.FloatField: float,
                                          models.CharField: str, models.TextField: str}


def insert_ignoring_conflicts(model: type[models.Model], rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert ``rows`` (field attnames to values: ``run_id``, not ``run``); a row that breaks a unique
    constraint is skipped, as ``bulk_create(ignore_conflicts=True)`` skips it."""
    if not rows:
        return
    fields = [f for f in model._meta.concrete_fields if not f.primary_key]
    unknown = set().union(*(row.keys() for row in rows)) - {f.attname for f in fields}
    if unknown:
        raise ValueError(f"{model.__name__} has no fields {sorted(unknown)}")
    now = timezone.now()
    defaults: dict[str, Any] = {}
    for f in fields:
        if getattr(f, "auto_now", False) or getattr(f, "auto_now_add", False):
            defaults[f.attname] = now
        else:  # what the ORM gives a field left unset: its default, None, or "" for a text field
            defaults[f.attname] = f.get_default()
    quote = connection.ops.quote_name
    sql = (f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(quote(f.column) for f in fields)}) "
           f"VALUES ({', '.join(['%s'] * len(fields))}) ON CONFLICT DO NOTHING")
    prep = [_preparer(f) for f in fields]
    params = [[p(row[f.attname] if f.attname in row else defaults[f.attname]) for f, p in zip(fields, prep, strict=True)]
              for row in rows]
    with connection.cursor() as cursor:
        cursor.executemany(sql, params)


def _preparer(f: models.Field) -> Callable[[Any], Any]:
    """``f.get_db_prep_save`` for this connection, without its layers of calls for the common cases: a value
    of the type the field stores goes as it is, a list or dict straight to the backend's JSON adapter (SQL
    NULL for None, as the field stores it). A rollout's 128 rows x 27 fields took 6.9-12.7 ms
    through ``get_db_prep_save``, held on the GPU worker's GIL; a third of that this way (the same values)."""
    slow = f.get_db_prep_save
    if isinstance(f, models.JSONField):
        adapt, encoder = connection.ops.adapt_json_value, f.encoder
        return lambda v: None if v is None else adapt(v, encoder) if type(v) in (list, dict) else slow(v, connection)
    kind: type | None
    if isinstance(f, models.ForeignKey):
        kind = int if isinstance(f.target_field, models.IntegerField) else None
    else:
        kind = int if isinstance(f, models.IntegerField) else _AS_IS.get(type(f))
    if kind is None:
        return lambda v: slow(v, connection)
    return lambda v: v if type(v) is kind or v is None else slow(v, connection)
