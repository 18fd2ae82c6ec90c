"""/api/v1/policy-versions/: listing, promote to an alias, rollback, and the append-only history."""

from __future__ import annotations

import pytest

from tests import factories
from webapp.runs.models import AliasEvent, PolicyVersion

pytestmark = pytest.mark.django_db


@pytest.fixture
def versions(user):
    """v0 (the base model) to v3, each evaluated a little better than the last, so the gate lets them pass."""
    run = factories.run(user)
    domain = run.run_domains.get().domain
    rows = [PolicyVersion.objects.create(run=run, number=n, step=n) for n in (0, 1, 2, 3)]
    for n, row in enumerate(rows):
        factories.evaluation(row, domain, [1.0] * (10 * n) + [0.0] * (40 - 10 * n))
    return rows[1:]


def test_list_is_scoped_to_the_owner(api, other_api, versions):
    assert [v["number"] for v in api.get(f"/api/v1/policy-versions/?run={versions[0].run_id}").json()["results"]] == [
        0, 1, 2, 3]
    assert other_api.get("/api/v1/policy-versions/").json()["count"] == 0
    assert other_api.post(f"/api/v1/policy-versions/{versions[0].pk}/promote/", {}, format="json").status_code == 404


def test_promote_then_rollback(api, versions):
    v1, v2, _ = versions
    assert api.post(f"/api/v1/policy-versions/{v1.pk}/promote/", {"alias": "production"}, format="json").status_code == 200
    assert api.post(f"/api/v1/policy-versions/{v2.pk}/promote/", {"reason": "better"}, format="json").status_code == 200
    listed = {v["number"]: v["aliases"] for v in api.get("/api/v1/policy-versions/").json()["results"]}
    assert listed[2] == ["production"] and listed[1] == ["previous"]

    again = api.post(f"/api/v1/policy-versions/{v2.pk}/promote/", {}, format="json")
    assert again.status_code == 409 and "already points" in again.json()["detail"]

    base_model = v1.run.base_model_id
    back = api.post("/api/v1/policy-versions/rollback/", {"base_model": base_model, "alias": "production"}, format="json")
    assert back.status_code == 200 and back.json()["version_number"] == 1
    listed = {v["number"]: v["aliases"] for v in api.get("/api/v1/policy-versions/").json()["results"]}
    assert "production" in listed[1]

    history = api.get(f"/api/v1/policy-versions/history/?base_model={base_model}").json()
    assert [(h["alias"], h["action"], h["version_number"]) for h in history if h["alias"] == "production"] == [
        ("production", "rollback", 1), ("production", "promote", 2), ("production", "promote", 1)]
    assert AliasEvent.objects.count() == 4  # three production moves and one previous


def test_rollback_without_history_is_409(api, versions):
    response = api.post("/api/v1/policy-versions/rollback/",
                        {"base_model": versions[0].run.base_model_id, "alias": "canary"}, format="json")
    assert response.status_code == 409 and "no earlier version" in response.json()["detail"]


def test_promote_to_previous_or_unknown_alias_is_refused(api, versions):
    for alias in ("previous", "nonsense"):
        response = api.post(f"/api/v1/policy-versions/{versions[0].pk}/promote/", {"alias": alias}, format="json")
        assert response.status_code == 400
    assert not AliasEvent.objects.exists()
