"""Metric points: writing them with per-run sequence numbers, and reading series downsampled.

Sequence numbers let a live page notice a gap (a dropped websocket message) and backfill it over REST
with ``since_seq``. Downsampling happens in the database: each bucket of steps keeps its minimum and its
maximum, so a spike survives however long the series grows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import Count, F, FloatField, IntegerField, Max, Min, Q
from django.db.models.functions import Cast, Floor
from django.utils import timezone

from webapp.runs.models import MetricPoint, Run


@dataclass(frozen=True)
class Point:
    name: str
    step: int
    value: float
    domain_id: int | None = None
    time: datetime | None = None


def record_points(run_id: int, points: Sequence[Point]) -> list[MetricPoint]:
    """Persist points in one batch, allocating consecutive sequence numbers under the run's row lock."""
    if not points:
        return []
    now = timezone.now()
    with transaction.atomic():
        Run.objects.filter(pk=run_id).update(metric_seq=F("metric_seq") + len(points))
        last = Run.objects.filter(pk=run_id).values_list("metric_seq", flat=True).get()
        first = last - len(points) + 1
        rows = [
            MetricPoint(run_id=run_id, name=p.name, step=p.step, value=p.value, domain_id=p.domain_id,
                        time=p.time or now, seq=first + i)
            for i, p in enumerate(points)
        ]
        MetricPoint.objects.bulk_create(rows)
    return rows


def series(
    run_id: int, *, names: Sequence[str] | None = None, domain_id: int | None = None,
    since_seq: int | None = None, max_points: int | None = None,
    step_min: int | None = None, step_max: int | None = None,
) -> dict[str, Any]:
    """Series of a run as ``{"series": [{"name", "domain", "points": [[step, value, seq], ...]}], "last_seq"}``.

    With ``since_seq`` only newer points come back (raw: a backfill must not lose any). With
    ``max_points`` a longer series is reduced in the database to about that many points: per bucket of
    steps its min (drawn at the bucket's first step) and its max (at its last step); such a series
    carries ``"downsampled": true``. ``step_min``/``step_max`` bound the steps (inclusive): a zoomed chart
    asks for its window again and gets finer points.
    """
    qs = MetricPoint.objects.filter(run_id=run_id)
    if step_min is not None:
        qs = qs.filter(step__gte=step_min)
    if step_max is not None:
        qs = qs.filter(step__lte=step_max)
    if names:
        qs = qs.filter(name__in=names)
    if domain_id is not None:
        qs = qs.filter(domain_id=domain_id)
    last_seq = Run.objects.filter(pk=run_id).values_list("metric_seq", flat=True).first() or 0
    if since_seq is not None:
        qs = qs.filter(seq__gt=since_seq)
        out: dict[tuple[str, int | None], list[list[float]]] = {}
        for name, dom, step, value, seq in qs.order_by("seq").values_list("name", "domain_id", "step", "value", "seq"):
            out.setdefault((name, dom), []).append([step, value, seq])
        return {"series": [{"name": n, "domain": d, "points": p, "downsampled": False} for (n, d), p in out.items()],
                "last_seq": last_seq}

    stats = qs.values("name", "domain_id").annotate(n=Count("id"), lo=Min("step"), hi=Max("step")).order_by("name", "domain_id")
    result = []
    for s in stats:
        one = qs.filter(name=s["name"]).filter(Q(domain_id=s["domain_id"]) if s["domain_id"] else Q(domain__isnull=True))
        if max_points is None or s["n"] <= max_points:
            points = [list(p) for p in one.order_by("step", "seq").values_list("step", "value", "seq")]
            result.append({"name": s["name"], "domain": s["domain_id"], "points": points, "downsampled": False})
            continue
        buckets = max(1, max_points // 2)
        width = (s["hi"] - s["lo"] + 1) / buckets
        rows = (
            one.annotate(bucket=Cast(Floor((F("step") - s["lo"]) / Cast(width, FloatField())), IntegerField()))
            .values("bucket")
            .annotate(s_lo=Min("step"), s_hi=Max("step"), v_lo=Min("value"), v_hi=Max("value"), seq=Max("seq"))
            .order_by("bucket")
        )
        points = []
        for r in rows:
            points.append([r["s_lo"], r["v_lo"], r["seq"]])
            if r["s_hi"] != r["s_lo"] or r["v_hi"] != r["v_lo"]:
                points.append([r["s_hi"], r["v_hi"], r["seq"]])
        result.append({"name": s["name"], "domain": s["domain_id"], "points": points, "downsampled": True})
    return {"series": result, "last_seq": last_seq}


def series_names(run_id: int) -> list[str]:
    """The distinct metric names of a run, by a loose index scan: one index probe per name, not a full scan."""
    table = MetricPoint._meta.db_table
    sql = (
        f"WITH RECURSIVE t(name) AS ("
        f" SELECT MIN(name) FROM {table} WHERE run_id = %s"
        f" UNION ALL"
        f" SELECT (SELECT MIN(name) FROM {table} WHERE run_id = %s AND name > t.name) FROM t WHERE t.name IS NOT NULL"
        f") SELECT name FROM t WHERE name IS NOT NULL"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [run_id, run_id])
        return [row[0] for row in cursor.fetchall()]
