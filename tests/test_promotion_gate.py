"""Comparison of versions per domain and the promotion gate: a planted regression in one domain is
flagged and blocks promotion even though the average score rises."""

from __future__ import annotations

import pytest

from tests import factories
from webapp.runs.models import AliasEvent, PolicyVersion, RunEvent
from webapp.runs.services import DomainWeight, do_create_run

pytestmark = pytest.mark.django_db


@pytest.fixture
def two_domains(user):
    v = factories.verifier(user)
    add = factories.domain(user, name="addition", verifier_row=v)
    mul = factories.domain(user, name="multiplication", verifier_row=v)
    run = do_create_run(user, name="r", base_model=factories.base_model(user), domains=[DomainWeight(add), DomainWeight(mul)])
    v0 = PolicyVersion.objects.create(run=run, number=0)
    v1 = PolicyVersion.objects.create(run=run, number=1, parent=v0)
    # the base model: 40 % on both domains (tasks t0..t49)
    factories.evaluation(v0, add, [1.0] * 20 + [0.0] * 30)
    factories.evaluation(v0, mul, [1.0] * 20 + [0.0] * 30)
    return run, add, mul, v0, v1


def test_planted_regression_is_flagged_although_the_average_rises(api, two_domains):
    run, add, mul, _, v1 = two_domains
    # v1 was trained on multiplication only: +40 points there, -16 on addition (8 of its 20 passes lost)
    factories.evaluation(v1, mul, [1.0] * 40 + [0.0] * 10)
    factories.evaluation(v1, add, [1.0] * 12 + [0.0] * 38)
    body = api.get(f"/api/v1/policy-versions/{v1.pk}/compare/?against=base").json()
    assert body["gain"] == pytest.approx(0.12) and body["regressions"] == ["addition"]
    rows = {d["domain"]: d for d in body["domains"]}
    assert rows["addition"]["delta"] == pytest.approx(-0.16) and rows["addition"]["ci95"][1] < 0
    assert rows["multiplication"]["improvement"] and not rows["multiplication"]["regression"]
    assert rows["addition"]["paired_tasks"] == 50
    assert any("addition regressed" in r for r in body["gate"]["production"])

    refused = api.post(f"/api/v1/policy-versions/{v1.pk}/promote/", {"alias": "production"}, format="json")
    assert refused.status_code == 409
    assert "addition regressed against v0 of run" in refused.json()["detail"]
    assert not AliasEvent.objects.exists()
    # a non-gated alias moves; a forced promotion moves and records the overridden reasons
    assert api.post(f"/api/v1/policy-versions/{v1.pk}/promote/", {"alias": "candidate"}, format="json").status_code == 200
    forced = api.post(f"/api/v1/policy-versions/{v1.pk}/promote/", {"alias": "production", "force": True},
                      format="json")
    assert forced.status_code == 200 and "forced past the gate" in forced.json()["reason"]
    assert RunEvent.objects.filter(run=run, kind="alias.promote", level="warning").count() == 1


def test_a_small_noisy_drop_is_not_a_regression(api, two_domains):
    _, add, mul, _, v1 = two_domains
    factories.evaluation(v1, mul, [1.0] * 30 + [0.0] * 20)
    # addition: one task lost, one gained, one more lost: -2 % is within noise
    factories.evaluation(v1, add, [0.0] + [1.0] * 18 + [0.0] * 31)
    body = api.get(f"/api/v1/policy-versions/{v1.pk}/compare/").json()  # against the parent, v0
    assert body["regressions"] == [] and body["baseline"] == 0
    assert api.post(f"/api/v1/policy-versions/{v1.pk}/promote/", {"alias": "production"}, format="json").status_code == 200


def test_gate_needs_evaluations_and_a_minimum_gain(api, two_domains, user):
    run, add, mul, _, v1 = two_domains
    missing = api.post(f"/api/v1/policy-versions/{v1.pk}/promote/", {"alias": "canary"}, format="json")
    assert missing.status_code == 409 and "not evaluated on both sides" in missing.json()["detail"]
    factories.evaluation(v1, mul, [1.0] * 21 + [0.0] * 29)
    factories.evaluation(v1, add, [1.0] * 20 + [0.0] * 30)
    run.base_model.promotion_gate = {"min_gain": 0.05}
    run.base_model.save()
    low = api.post(f"/api/v1/policy-versions/{v1.pk}/promote/", {"alias": "canary"}, format="json")
    assert low.status_code == 409 and "below the gate's minimum +0.050" in low.json()["detail"]
    run.base_model.promotion_gate = {"min_gain": "lots"}
    run.base_model.save()
    bad = api.post(f"/api/v1/policy-versions/{v1.pk}/promote/", {"alias": "canary"}, format="json")
    assert bad.status_code == 400 and "min_gain" in bad.json()["errors"]


def test_compare_against_an_alias_or_a_version_and_bad_targets(api, two_domains, other_api):
    _, add, mul, v0, v1 = two_domains
    factories.evaluation(v1, mul, [1.0] * 25 + [0.0] * 25)
    factories.evaluation(v1, add, [1.0] * 25 + [0.0] * 25)
    assert api.post(f"/api/v1/policy-versions/{v1.pk}/promote/", {}, format="json").status_code == 200
    body = api.get(f"/api/v1/policy-versions/{v0.pk}/compare/?against=production").json()
    # v0 against v1: the same 5 tasks lost in each domain and none gained: a drop beyond noise
    assert body["baseline"] == 1 and body["regressions"] == ["addition", "multiplication"]
    assert api.get(f"/api/v1/policy-versions/{v1.pk}/compare/?against={v0.pk}").json()["baseline"] == 0
    assert api.get(f"/api/v1/policy-versions/{v1.pk}/compare/?against=nonsense").status_code == 400
    assert other_api.get(f"/api/v1/policy-versions/{v1.pk}/compare/").status_code == 404
    evaluations = api.get(f"/api/v1/policy-versions/{v1.pk}/evaluations/").json()
    assert {e["domain_name"] for e in evaluations} == {"addition", "multiplication"}


def test_the_gate_is_set_per_base_model_through_the_api(api, user):
    bm = factories.base_model(user)
    ok = api.patch(f"/api/v1/base-models/{bm.pk}/", {"promotion_gate": {"min_gain": 0.02}}, format="json")
    assert ok.status_code == 200 and ok.json()["promotion_gate"]["min_gain"] == 0.02
    assert ok.json()["promotion_gate"]["aliases"] == ["production", "canary"]
    bad = api.patch(f"/api/v1/base-models/{bm.pk}/", {"promotion_gate": {"min_gain": 7, "typo": 1}}, format="json")
    assert bad.status_code == 400
    assert "min_gain" in str(bad.json()) and "typo" in str(bad.json())


def test_the_gate_names_the_layer_a_regression_is_in(api, user):
    """Two layers: capability items (a single-turn domain) and end-to-end tasks (an environment domain's
    episodes). A version that gains on the capability layer and loses on the end-to-end one (it learnt to
    answer without the tool) is refused, and the refusal names the layer and the domain."""
    v = factories.verifier(user)
    add = factories.domain(user, name="addition", verifier_row=v)
    tool = factories.domain(user, name="product", verifier_row=v)
    tool.environment = "python_tool"
    tool.save(update_fields=["environment"])
    run = do_create_run(user, name="layers", base_model=factories.base_model(user),
                        domains=[DomainWeight(add), DomainWeight(tool)])
    v0 = PolicyVersion.objects.create(run=run, number=0)
    v1 = PolicyVersion.objects.create(run=run, number=1, parent=v0)
    factories.evaluation(v0, add, [1.0] * 20 + [0.0] * 30)
    factories.evaluation(v0, tool, [1.0] * 40 + [0.0] * 10)
    factories.evaluation(v1, add, [1.0] * 45 + [0.0] * 5)   # +50 points on the capability layer
    factories.evaluation(v1, tool, [1.0] * 25 + [0.0] * 25)  # -30 points end to end
    body = api.get(f"/api/v1/policy-versions/{v1.pk}/compare/?against=base").json()
    assert body["gain"] > 0  # the average rises: one number would hide the loss
    layers = body["layers"]
    assert layers["capability"]["regressions"] == [] and layers["capability"]["gain"] == pytest.approx(0.5)
    assert layers["end_to_end"]["regressions"] == ["product"] and layers["end_to_end"]["gain"] == pytest.approx(-0.3)
    assert {d["domain"]: d["layer"] for d in body["domains"]} == {"addition": "capability", "product": "end_to_end"}
    refused = api.post(f"/api/v1/policy-versions/{v1.pk}/promote/", {"alias": "production"}, format="json")
    assert refused.status_code == 409
    assert "end-to-end layer: product regressed against v0" in refused.json()["detail"]
    assert "capability layer" not in refused.json()["detail"]
    from django.test import Client

    client = Client()
    client.force_login(user)
    page = client.get(f"/versions/{v1.pk}/").content.decode()
    assert "end-to-end" in page and "layer average" in page and "regression: product" in page
