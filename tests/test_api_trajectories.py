"""/api/v1/trajectories/: filters, cursor pagination, detail, ownership and constant query counts."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tests import factories
from webapp.runs.models import Trajectory

pytestmark = pytest.mark.django_db


def make_trajectories(run, n: int, domain=None, prefix: str = "g"):
    domain = domain or run.run_domains.first().domain
    Trajectory.objects.bulk_create([
        Trajectory(run=run, domain=domain, group_key=f"{prefix}{i // 4}", sample_index=i % 4, version=i % 3,
                   prompt=f"p{i}", completion=f"c{i}", verdict=["pass", "fail", "invalid"][i % 3],
                   reward=None if i % 3 == 2 else float(i % 3 == 0), behaviour_logprobs=[-0.1] * 4)
        for i in range(n)
    ])


def test_filters(api, user):
    run = factories.run(user)
    make_trajectories(run, 30)
    base = f"/api/v1/trajectories/?run={run.pk}"
    assert len(api.get(base).json()["results"]) == 30
    passed = api.get(base + "&verdict=pass").json()["results"]
    assert len(passed) == 10 and {t["verdict"] for t in passed} == {"pass"}
    assert {t["version"] for t in api.get(base + "&version=1").json()["results"]} == {1}
    high = api.get(base + "&reward_min=0.5").json()["results"]
    assert len(high) == 10 and all(t["reward"] == 1.0 for t in high)
    assert len(api.get(base + "&reward_max=0.5").json()["results"]) == 10
    assert api.get(base + "&verdict=bogus").status_code == 400
    group = api.get(base + "&group_key=g0").json()["results"]
    assert sorted(t["sample_index"] for t in group) == [0, 1, 2, 3]


def test_cursor_pages_cover_everything_once(api, user):
    run = factories.run(user)
    make_trajectories(run, 250)
    ids: list[int] = []
    url = f"/api/v1/trajectories/?run={run.pk}&page_size=100"
    while url:
        page = api.get(url).json()
        ids += [t["id"] for t in page["results"]]
        url = page["next"]
    assert len(ids) == 250 == len(set(ids)) and ids == sorted(ids, reverse=True)


def test_detail_has_tokens_and_list_does_not(api, user):
    run = factories.run(user)
    make_trajectories(run, 1)
    listed = api.get(f"/api/v1/trajectories/?run={run.pk}").json()["results"][0]
    assert "behaviour_logprobs" not in listed
    detail = api.get(f"/api/v1/trajectories/{listed['id']}/").json()
    assert detail["behaviour_logprobs"] == [-0.1] * 4


def test_other_users_trajectories_are_invisible(other_api, user):
    run = factories.run(user)
    make_trajectories(run, 5)
    assert other_api.get(f"/api/v1/trajectories/?run={run.pk}").json()["results"] == []
    assert other_api.get(f"/api/v1/trajectories/{Trajectory.objects.first().pk}/").status_code == 404


def test_list_query_count_is_constant(api, user):
    run = factories.run(user)
    make_trajectories(run, 3)
    with CaptureQueriesContext(connection) as few:
        api.get(f"/api/v1/trajectories/?run={run.pk}")
    make_trajectories(run, 90, domain=factories.domain(user, name="other"), prefix="h")
    with CaptureQueriesContext(connection) as many:
        assert len(api.get(f"/api/v1/trajectories/?run={run.pk}").json()["results"]) == 93
    assert len(many) == len(few)
    assert not any("COUNT(" in q["sql"].upper() for q in many.captured_queries)
