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

from collections.abc import Mapping, Sequence
from typing import Any

from django.db import connection, models
from django.utils import timezone


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
    params = []
    for row in rows:
        values = []
        for f in fields:
            value = row[f.attname] if f.attname in row else defaults[f.attname]
            values.append(f.get_db_prep_save(value, connection))
        params.append(values)
    with connection.cursor() as cursor:
        cursor.executemany(sql, params)
