"""/api/v1/metrics/: per-run sequence numbers, since_seq backfill and spike-keeping downsampling."""

from __future__ import annotations

import pytest

from tests import factories
from webapp.runs.metrics import Point, record_points

pytestmark = pytest.mark.django_db


def test_sequence_numbers_and_since_seq(api, user):
    run = factories.run(user)
    first = record_points(run.pk, [Point("reward", s, s / 10) for s in range(5)])
    second = record_points(run.pk, [Point("loss", s, 1.0) for s in range(3)])
    assert [p.seq for p in first + second] == list(range(1, 9))
    body = api.get(f"/api/v1/metrics/?run={run.pk}&since_seq=5").json()
    assert body["last_seq"] == 8
    points = {s["name"]: s["points"] for s in body["series"]}
    assert points == {"loss": [[0, 1.0, 6], [1, 1.0, 7], [2, 1.0, 8]]}
    assert [p[2] for p in points["loss"]] == [6, 7, 8]


def test_full_series_and_name_and_domain_filters(api, user):
    run = factories.run(user)
    domain = run.run_domains.first().domain
    record_points(run.pk, [Point("reward", s, 0.5, domain_id=domain.pk) for s in range(4)]
                  + [Point("reward", s, 0.1) for s in range(2)] + [Point("loss", 0, 2.0)])
    body = api.get(f"/api/v1/metrics/?run={run.pk}&name=reward").json()
    series = {(s["name"], s["domain"]): len(s["points"]) for s in body["series"]}
    assert series == {("reward", domain.pk): 4, ("reward", None): 2}
    only = api.get(f"/api/v1/metrics/?run={run.pk}&domain={domain.pk}").json()["series"]
    assert [(s["name"], s["domain"]) for s in only] == [("reward", domain.pk)]


def test_downsampling_keeps_the_spike(api, user):
    run = factories.run(user)
    values = [0.5] * 10_000
    values[7_777] = 99.0
    values[1_234] = -42.0
    record_points(run.pk, [Point("loss", s, v) for s, v in enumerate(values)])
    series = api.get(f"/api/v1/metrics/?run={run.pk}&name=loss&max_points=200").json()["series"][0]
    assert series["downsampled"] is True
    assert len(series["points"]) <= 200
    got = [p[1] for p in series["points"]]
    assert max(got) == 99.0 and min(got) == -42.0
    steps = [p[0] for p in series["points"]]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == 9_999


def test_bad_queries_and_foreign_runs(api, other_api, user):
    run = factories.run(user)
    assert api.get("/api/v1/metrics/").status_code == 400
    assert api.get(f"/api/v1/metrics/?run={run.pk}&max_points=1").status_code == 400
    assert other_api.get(f"/api/v1/metrics/?run={run.pk}").status_code == 404


def test_long_series_read_from_rollups_keep_spikes_and_windows(api, user):
    from webapp.runs.metrics import RAW_DOWNSAMPLE_LIMIT

    run = factories.run(user)
    n = RAW_DOWNSAMPLE_LIMIT * 3
    values = [0.5] * n
    values[12_345] = 99.0
    values[54_321] = -42.0
    for start in range(0, n, 5_000):  # in batches, as workers emit them
        record_points(run.pk, [Point("loss", s, values[s]) for s in range(start, min(n, start + 5_000))])
    series = api.get(f"/api/v1/metrics/?run={run.pk}&name=loss&max_points=500").json()["series"][0]
    assert series["downsampled"] is True and len(series["points"]) <= 500
    got = [p[1] for p in series["points"]]
    assert max(got) == 99.0 and min(got) == -42.0
    steps = [p[0] for p in series["points"]]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == n - 1
    # a zoomed window asks again and gets finer points, still with the spike
    zoom = api.get(f"/api/v1/metrics/?run={run.pk}&name=loss&max_points=500&step_min=12000&step_max=13000").json()
    points = zoom["series"][0]["points"]
    assert points[0][0] >= 12000 and points[-1][0] <= 13000 and max(p[1] for p in points) == 99.0
    assert 400 <= len(points) <= 500  # finer: 1,001 raw points in the window, bucketed by 2 steps


def test_rollups_written_incrementally_equal_a_rebuild(user):
    from webapp.runs.metrics import rebuild_rollups
    from webapp.runs.models import MetricRollup

    run = factories.run(user)
    domain = run.run_domains.first().domain
    record_points(run.pk, [Point("reward", s, s % 7, domain_id=domain.pk) for s in range(0, 3000, 3)])
    record_points(run.pk, [Point("reward", s, -s, domain_id=domain.pk) for s in range(1, 3000, 3)])  # interleaved
    record_points(run.pk, [Point("loss", s, 1.0 / (s + 1)) for s in range(2000)])

    def snapshot():
        return sorted(MetricRollup.objects.filter(run=run).values_list(
            "name", "domain_key", "level", "bucket", "step_lo", "step_hi", "v_min", "v_max", "n", "seq_max"))

    incremental = snapshot()
    rebuild_rollups(run.pk)
    assert snapshot() == incremental and len(incremental) > 0
