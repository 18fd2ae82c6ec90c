"""A run over 300 domains: it starts, admits prompts from every domain in proportion to its weight, trains,
and reports metrics per domain (real Redis, real Celery workers, the torch engine, tiny domains)."""

from __future__ import annotations

import time

import pytest
from django.db.models import Count

from tests import factories
from tests.test_pipeline import assert_counts_add_up, wait_status
from webapp.catalog.models import BaseModel, Task, TaskDomain
from webapp.runs.models import MetricPoint, PromptGroup

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

DOMAINS = 300


def test_three_hundred_domains_are_scheduled_by_weight_and_reported_per_domain(start_worker, api, user):
    start_worker("control")
    start_worker("rollout,train")
    start_worker("verify")
    verifier = factories.verifier(user, name="exact")
    domains = TaskDomain.objects.bulk_create([
        TaskDomain(owner=user, name=f"add-{i:03d}", kind="answer", verifier=verifier, task_count=2)
        for i in range(DOMAINS)])
    Task.objects.bulk_create([Task(domain=d, prompt=f"{10 + i % 90}+{11 + j}=", reference={"answer": str(21 + i % 90 + j)})
                              for i, d in enumerate(domains) for j in range(2)])
    weights = {d.pk: 2.0 if i % 3 == 0 else 1.0 for i, d in enumerate(domains)}  # 100 at 2, 200 at 1
    bm = BaseModel.objects.create(owner=user, name="demo", path="assets/base-models/demo")
    spec = {"algorithm": {"learning_rate": 1e-3, "lora_rank": 8, "updates_per_batch": 1},
            "pipeline": {"group_size": 2, "batch_prompts": 100, "max_staleness": 1, "rollout_batch_prompts": 100},
            "sampling": {"max_tokens": 3, "stop": ["\n"]}, "max_steps": 4, "eval_every": 0}
    started = time.monotonic()
    response = api.post("/api/v1/runs/", {"name": "wide", "base_model": bm.pk, "spec": spec, "domains": [
        {"domain": pk, "weight": w} for pk, w in weights.items()]}, format="json")
    assert response.status_code == 201, response.content
    run_id = response.json()["id"]
    assert len(response.json()["domains"]) == DOMAINS
    assert api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json").status_code == 200
    run = wait_status(run_id, {"completed"}, timeout=300)
    elapsed = time.monotonic() - started
    assert_counts_add_up(run)
    # 4 steps x 100 groups = 400 admissions over a total weight of 400: one per weight unit, exactly
    admitted = dict(PromptGroup.objects.filter(run=run).values_list("domain_id").annotate(n=Count("id")))
    assert set(admitted) == set(weights)
    assert all(abs(admitted[pk] - w) <= 1 for pk, w in weights.items()), {
        pk: (admitted[pk], w) for pk, w in weights.items() if abs(admitted[pk] - w) > 1}
    assert sum(admitted.values()) == 400
    # per-domain series: reward and pass rate for every domain that trained
    trained = set(PromptGroup.objects.filter(run=run, status="trained").values_list("domain_id", flat=True))
    assert len(trained) == DOMAINS
    reported = set(MetricPoint.objects.filter(run=run, name="reward", domain__isnull=False)
                   .values_list("domain_id", flat=True))
    assert reported == trained
    one = next(iter(weights))
    series = api.get(f"/api/v1/metrics/?run={run_id}&name=reward&name=pass_rate&domain={one}").json()["series"]
    assert {s["name"] for s in series} == {"reward", "pass_rate"} and all(s["domain"] == one for s in series)
    print(f"300 domains: 4 steps in {elapsed:.0f} s")
