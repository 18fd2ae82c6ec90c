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
from django.db.models import Count, F, FloatField, IntegerField, Max, Min, Q, Sum, Value
from django.db.models.functions import Cast, Floor
from django.utils import timezone

from webapp.runs.models import MetricPoint, MetricRollup, Run

# Rollup bucket widths in steps (finest first); changing them needs a migration that refills the rollups.
ROLLUP_WIDTHS = (32, 1024, 32768)
# Up to this many raw points a series is bucketed directly; beyond, from its rollups.
RAW_DOWNSAMPLE_LIMIT = 20_000


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
        _roll_up(run_id, rows)
    return rows


def _roll_up(run_id: int, rows: Sequence[MetricPoint]) -> None:
    """Merge the points into their rollup buckets (min/max/count per bucket), one upsert per bucket."""
    buckets: dict[tuple[str, int, int, int], list[float]] = {}
    for r in rows:
        for level, width in enumerate(ROLLUP_WIDTHS):
            key = (r.name, r.domain_id or 0, level, r.step // width)
            b = buckets.get(key)
            if b is None:
                buckets[key] = [r.step, r.step, r.value, r.value, 1, r.seq]
            else:
                b[0], b[1] = min(b[0], r.step), max(b[1], r.step)
                b[2], b[3] = min(b[2], r.value), max(b[3], r.value)
                b[4] += 1
                b[5] = max(b[5], r.seq)
    table = MetricRollup._meta.db_table
    least, greatest = ("LEAST", "GREATEST") if connection.vendor == "postgresql" else ("MIN", "MAX")
    sql = (
        f"INSERT INTO {table} (run_id, name, domain_key, level, bucket, step_lo, step_hi, v_min, v_max, n, seq_max) "
        f"VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
        f"ON CONFLICT (run_id, name, domain_key, level, bucket) DO UPDATE SET "
        f"step_lo = {least}({table}.step_lo, EXCLUDED.step_lo), step_hi = {greatest}({table}.step_hi, EXCLUDED.step_hi), "
        f"v_min = {least}({table}.v_min, EXCLUDED.v_min), v_max = {greatest}({table}.v_max, EXCLUDED.v_max), "
        f"n = {table}.n + EXCLUDED.n, seq_max = {greatest}({table}.seq_max, EXCLUDED.seq_max)"
    )
    with connection.cursor() as cursor:
        cursor.executemany(sql, [(run_id, *key, *b) for key, b in sorted(buckets.items())])


def rebuild_rollups(run_id: int) -> None:
    """Recompute a run's rollups from its raw points (for points written by other means than record_points)."""
    table, points = MetricRollup._meta.db_table, MetricPoint._meta.db_table
    with transaction.atomic(), connection.cursor() as cursor:
        MetricRollup.objects.filter(run_id=run_id).delete()
        for level, width in enumerate(ROLLUP_WIDTHS):
            cursor.execute(
                f"INSERT INTO {table} (run_id, name, domain_key, level, bucket, step_lo, step_hi, v_min, v_max, n, "
                f"seq_max) SELECT run_id, name, COALESCE(domain_id, 0), {level}, "
                f"CAST(FLOOR(step * 1.0 / {width}) AS BIGINT) AS b, MIN(step), MAX(step), MIN(value), MAX(value), "
                f"COUNT(*), MAX(seq) FROM {points} WHERE run_id = %s GROUP BY run_id, name, COALESCE(domain_id, 0), b",
                [run_id],
            )


def series(
    run_id: int, *, names: Sequence[str] | None = None, domain_id: int | None = None, overall: bool = False,
    since_seq: int | None = None, max_points: int | None = None,
    step_min: int | None = None, step_max: int | None = None,
) -> dict[str, Any]:
    """Series of a run as ``{"series": [{"name", "domain", "points": [[step, value, seq], ...]}], "last_seq"}``.

    With ``since_seq`` only newer points come back (raw: a backfill must not lose any). With
    ``max_points`` a longer series is reduced in the database to about that many points: per bucket of
    steps its min (drawn at the bucket's first step) and its max (at its last step); such a series
    carries ``"downsampled": true``. ``step_min``/``step_max`` bound the steps (inclusive): a zoomed chart
    asks for its window again and gets finer points. ``overall`` leaves the per-domain series out (a run
    with a hundred domains draws those as a heatmap, ``webapp.runs.heatmap``).
    """
    qs = MetricPoint.objects.filter(run_id=run_id)
    if overall:
        qs = qs.filter(domain__isnull=True)
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
        for name, domain, step, value, seq in qs.order_by("seq").values_list("name", "domain_id", "step", "value",
                                                                              "seq"):
            out.setdefault((name, domain), []).append([step, value, seq])
        return {"series": [{"name": n, "domain": d, "points": p, "downsampled": False} for (n, d), p in out.items()],
                "last_seq": last_seq}

    result = []
    for (name, dom), (n, lo, hi) in _series_stats(run_id, qs, names, domain_id, step_min, step_max).items():
        if overall and dom is not None:
            continue
        one = qs.filter(name=name).filter(Q(domain_id=dom) if dom else Q(domain__isnull=True))
        if max_points is None or n <= max_points:
            points = [list(p) for p in one.order_by("step", "seq").values_list("step", "value", "seq")]
            result.append({"name": name, "domain": dom, "points": points, "downsampled": False})
            continue
        buckets = max(1, max_points // 2)
        width = (hi - lo + 1) / buckets
        level: int | None = _rollup_level(hi - lo + 1, max_points) if n > RAW_DOWNSAMPLE_LIMIT else None
        rows: Any
        if level is None:  # few enough raw points: bucket them directly
            rows = (
                one.annotate(bucket=Cast(Floor((F("step") - lo) / Value(width, FloatField())), IntegerField()))
                .values("bucket")
                .annotate(s_lo=Min("step"), s_hi=Max("step"), v_lo=Min("value"), v_hi=Max("value"), seq=Max("seq"))
                .order_by("bucket")
            )
        else:  # a long series: re-bucket its precomputed rollups (a few thousand rows, not n points)
            rollup_width = ROLLUP_WIDTHS[level]
            window = MetricRollup.objects.filter(run_id=run_id, name=name, domain_key=dom or 0, level=level)
            if step_min is not None:
                window = window.filter(bucket__gte=step_min // rollup_width)
            if step_max is not None:
                window = window.filter(bucket__lte=step_max // rollup_width)
            rows = (
                window.annotate(bucket_=Cast(Floor((F("step_lo") - lo) / Value(width, FloatField())), IntegerField()))
                .values("bucket_")
                .annotate(s_lo=Min("step_lo"), s_hi=Max("step_hi"), v_lo=Min("v_min"), v_hi=Max("v_max"),
                          seq=Max("seq_max"))
                .order_by("bucket_")
            )
        points = []
        for r in rows:  # a rollup bucket may straddle a window's edge: draw it at the edge
            s_lo, s_hi = min(max(r["s_lo"], lo), hi), min(max(r["s_hi"], lo), hi)
            points.append([s_lo, r["v_lo"], r["seq"]])
            if s_hi != s_lo or r["v_hi"] != r["v_lo"]:
                points.append([s_hi, r["v_hi"], r["seq"]])
        result.append({"name": name, "domain": dom, "points": points, "downsampled": True})
    return {"series": result, "last_seq": last_seq}


def _rollup_level(span: int, max_points: int) -> int:
    """The finest rollup level that holds at most ~8 rows per wanted point over ``span`` steps."""
    for level, width in enumerate(ROLLUP_WIDTHS):
        if span / width <= 8 * max_points:
            return level
    return len(ROLLUP_WIDTHS) - 1


def _series_stats(
    run_id: int, qs: Any, names: Sequence[str] | None, domain_id: int | None, step_min: int | None,
    step_max: int | None,
) -> dict[tuple[str, int | None], tuple[int, int, int]]:
    """(name, domain) -> (points, first step, last step), read from the coarsest rollup when there is one.

    Within a step window the count is that of the coarse buckets overlapping it: close enough to choose
    between raw points and rollups, and the steps are clamped to the window.
    """
    level = len(ROLLUP_WIDTHS) - 1
    if step_min is not None and step_max is not None:  # a zoom window: count it at the finest affordable level
        level = next((i for i, w in enumerate(ROLLUP_WIDTHS) if (step_max - step_min) / w <= 20_000), level)
    width = ROLLUP_WIDTHS[level]
    coarse = MetricRollup.objects.filter(run_id=run_id, level=level)
    if names:
        coarse = coarse.filter(name__in=names)
    if domain_id is not None:
        coarse = coarse.filter(domain_key=domain_id)
    if step_min is not None:
        coarse = coarse.filter(bucket__gte=step_min // width)
    if step_max is not None:
        coarse = coarse.filter(bucket__lte=step_max // width)
    rows = coarse.values("name", "domain_key").annotate(n=Sum("n"), lo=Min("step_lo"), hi=Max("step_hi"))
    stats = {(r["name"], r["domain_key"] or None): (r["n"], r["lo"], r["hi"]) for r in rows.order_by("name", "domain_key")}
    if not stats:  # points from before rollups existed, or none at all
        raw = qs.values("name", "domain_id").annotate(n=Count("id"), lo=Min("step"), hi=Max("step"))
        stats = {(r["name"], r["domain_id"]): (r["n"], r["lo"], r["hi"]) for r in raw.order_by("name", "domain_id")}
    lo_bound = step_min if step_min is not None else -(2**62)
    hi_bound = step_max if step_max is not None else 2**62
    return {k: (n, max(lo, lo_bound), min(hi, hi_bound)) for k, (n, lo, hi) in stats.items()}


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
