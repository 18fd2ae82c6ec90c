"""/api/v1/runs/: creation with a validated spec, the lifecycle actions, the calibration gate, ownership."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tests import factories
from webapp.runs.models import Run, RunEvent

pytestmark = pytest.mark.django_db


_counter = iter(range(1_000_000))


def make_payload(user, calibrated: bool = True, **overrides):
    n = next(_counter)
    v = factories.verifier(user, name=f"v{n}", calibrated=calibrated)
    d = factories.domain(user, name=f"add{n}", verifier_row=v)
    d2 = factories.domain(user, name=f"reverse{n}", verifier_row=v)
    bm = factories.base_model(user, name=f"bm{n}")
    payload = {"name": "first", "base_model": bm.pk,
               "domains": [{"domain": d.pk, "weight": 3}, {"domain": d2.pk, "weight": 1, "priority": 2}],
               "spec": {"max_steps": 50, "pipeline": {"group_size": 4}}}
    payload.update(overrides)
    return payload


def test_create_run_stores_validated_spec_with_defaults(api, user):
    response = api.post("/api/v1/runs/", make_payload(user), format="json")
    assert response.status_code == 201, response.content
    run = Run.objects.get(pk=response.json()["id"])
    assert run.status == "draft" and run.owner == user
    assert run.spec["max_steps"] == 50 and run.spec["pipeline"]["group_size"] == 4
    assert run.spec["algorithm"]["advantage"] == "grpo"  # defaults filled in
    assert sorted(rd.weight for rd in run.run_domains.all()) == [1.0, 3.0]
    assert run.events.filter(kind="created").exists()


@pytest.mark.parametrize(("spec", "field"), [
    ({"max_steps": 0}, "max_steps"),
    ({"pipeline": {"group_size": 1}}, "pipeline.group_size"),
    ({"algorithm": {"learning_rate": -1}}, "algorithm.learning_rate"),
    ({"bogus": 1}, "bogus"),
    ({"algorithm": {"clip_low": 0.3, "clip_high": 0.1}}, "spec"),
])
def test_invalid_spec_is_refused_with_the_field(api, user, spec, field):
    response = api.post("/api/v1/runs/", make_payload(user, spec=spec), format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()["errors"]
    assert not Run.objects.exists()


def test_run_needs_domains_with_positive_weights(api, user):
    payload = make_payload(user)
    payload["domains"] = []
    assert api.post("/api/v1/runs/", payload, format="json").status_code == 400
    payload = make_payload(user)
    payload["domains"][0]["weight"] = 0
    response = api.post("/api/v1/runs/", payload, format="json")
    assert response.status_code == 400 and "domains" in response.json()["errors"]


def test_cannot_use_another_users_domain_or_base_model(api, user, other_user):
    payload = make_payload(user)
    payload["base_model"] = factories.base_model(other_user, name="theirs").pk
    assert api.post("/api/v1/runs/", payload, format="json").status_code == 400
    payload = make_payload(user, name="again")
    payload["domains"] = [{"domain": factories.domain(other_user, name="theirs").pk}]
    assert api.post("/api/v1/runs/", payload, format="json").status_code == 400
    assert not Run.objects.exists()


def test_full_lifecycle_and_invalid_transitions(api, user):
    run_id = api.post("/api/v1/runs/", make_payload(user), format="json").json()["id"]

    def act(action: str, expected: int, body: dict | None = None) -> dict:
        response = api.post(f"/api/v1/runs/{run_id}/{action}/", body or {}, format="json")
        assert response.status_code == expected, (action, response.content)
        return response.json()

    assert "cannot pause" in act("pause", 409)["detail"]
    assert act("resume", 409)["errors"]["status"] == "draft"
    assert act("start", 200)["status"] == "queued"
    assert act("start", 409)["errors"]["allowed_from"] == ["draft"]
    Run.objects.filter(pk=run_id).update(status="running")  # the control worker's move
    assert act("pause", 200)["status"] == "pausing"
    assert act("resume", 409)["errors"]["status"] == "pausing"
    Run.objects.filter(pk=run_id).update(status="paused")
    assert act("resume", 200)["status"] == "queued"
    assert act("cancel", 200)["status"] == "cancelled"
    assert act("cancel", 409)["errors"]["status"] == "cancelled"
    assert act("start", 409)
    run = Run.objects.get(pk=run_id)
    assert run.finished_at is not None and run.status_reason == "cancelled by user"
    kinds = list(RunEvent.objects.filter(run=run).values_list("kind", flat=True))
    assert kinds == ["created", "status.queued", "status.pausing", "status.queued", "status.cancelled"]


def test_start_refuses_uncalibrated_verifier_unless_forced(api, user):
    run_id = api.post("/api/v1/runs/", make_payload(user, calibrated=False), format="json").json()["id"]
    refused = api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json")
    assert refused.status_code == 409
    assert "calibration" in refused.json()["detail"] and len(refused.json()["errors"]["uncalibrated"]) == 2
    assert Run.objects.get(pk=run_id).status == "draft"
    forced = api.post(f"/api/v1/runs/{run_id}/start/", {"force": True}, format="json")
    assert forced.status_code == 200 and forced.json()["forced_start"] is True
    event = RunEvent.objects.get(run_id=run_id, kind="forced_start")
    assert event.level == "warning" and len(event.data["uncalibrated"]) == 2


def test_other_user_cannot_see_or_steer_a_run(api, other_api, user):
    run_id = api.post("/api/v1/runs/", make_payload(user), format="json").json()["id"]
    assert other_api.get(f"/api/v1/runs/{run_id}/").status_code == 404
    assert other_api.post(f"/api/v1/runs/{run_id}/cancel/").status_code == 404
    assert other_api.delete(f"/api/v1/runs/{run_id}/").status_code == 404
    assert Run.objects.get(pk=run_id).status == "draft"


def test_staff_sees_every_run(user, other_user):
    from tests.conftest import token_client

    factories.run(user)
    other_user.is_staff = True
    other_user.save()
    assert token_client(other_user).get("/api/v1/runs/").json()["count"] == 1


def test_events_endpoint_and_delete_rules(api, user):
    run_id = api.post("/api/v1/runs/", make_payload(user), format="json").json()["id"]
    api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json")
    events = api.get(f"/api/v1/runs/{run_id}/events/").json()
    assert [e["kind"] for e in events] == ["created", "status.queued"]
    assert api.get(f"/api/v1/runs/{run_id}/events/?after={events[0]['id']}").json()[0]["kind"] == "status.queued"
    assert api.delete(f"/api/v1/runs/{run_id}/").status_code == 400  # queued: cancel first
    api.post(f"/api/v1/runs/{run_id}/cancel/")
    assert api.delete(f"/api/v1/runs/{run_id}/").status_code == 204
    assert not Run.objects.filter(pk=run_id).exists()


def test_run_list_query_count_is_constant(api, user):
    factories.run(user, name="a")
    with CaptureQueriesContext(connection) as few:
        api.get("/api/v1/runs/")
    for i in range(10):
        factories.run(user, name=f"r{i}")
    with CaptureQueriesContext(connection) as many:
        assert api.get("/api/v1/runs/").json()["count"] == 11
    assert len(many) == len(few)
