"""A real planted regression: a version trained only on multiplication (the demo GRPO loop, real weights),
evaluated by the real workers on both demo domains. Addition drops far beyond noise; the comparison flags
it and the gate refuses promotion to production, naming the domain. (That a regression is flagged even
when the average rises is `tests/test_promotion_gate.py`'s case.)

Measured here: addition 35 % → 17 % (1,000 held-out tasks, paired), multiplication 3.5 % → 3.5 %.
The earlier plant — trained on addition, multiplication regressing — depended on the CPU's float kernels:
multiplication starts at 3-6 % (5-9 of 144 tasks), and on this machine's CPU it went 3.5 % → 2.1 %, within
noise, so the test failed on a machine it had passed on. A plant whose effect is 18 points on 1,000 tasks
does not.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests import factories
from webapp.catalog.models import BaseModel
from webapp.catalog.services import do_import_tasks
from webapp.runs.loop import paths
from webapp.runs.models import Evaluation, PolicyVersion
from webapp.runs.services import DomainWeight, do_create_run

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
DEMO = Path(__file__).resolve().parent.parent / "assets" / "base-models" / "demo"


def test_version_trained_on_one_domain_regresses_the_other_and_is_refused(api, user, start_worker, tmp_path):
    import torch

    from workers.policy.demo_loop import run_grpo
    from workers.policy.demo_tasks import DOMAINS, _split_pool
    from workers.policy.trainer import TrainerConfig

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = run_grpo(DEMO, tmp_path / "grpo", domain="multiplication", config=TrainerConfig(seed=0, lr=1e-3),
                          max_steps=60, time_budget_s=1e9, eval_every=1000, seed=0)
    finally:
        torch.set_num_threads(threads)
    trained = tmp_path / "grpo" / f"v{report.steps:05d}"
    assert trained.exists()

    verifier = factories.verifier(user, name="exact")
    domains = []
    for name in DOMAINS:
        domain = factories.domain(user, name=name, verifier_row=verifier)
        do_import_tasks(domain, [json.dumps({"prompt": p, "answer": a, "split": "heldout"})
                                 for p, a in _split_pool(name, "heldout")])
        domains.append(domain)
    bm = BaseModel.objects.create(owner=user, name="demo", path=str(DEMO))
    run = do_create_run(user, name="multiplication only", base_model=bm, domains=[DomainWeight(d) for d in domains],
                        spec={"eval_tasks": 1000, "sampling": {"max_tokens": 6, "stop": ["\n"]}})
    v0 = PolicyVersion.objects.create(run=run, number=0)
    v1 = PolicyVersion.objects.create(run=run, number=1, step=report.steps, parent=v0)
    target = paths.version_dir(run.pk, 1)
    assert target is not None
    if target.exists():  # left by an earlier test run whose run had the same id
        shutil.rmtree(target)
    shutil.copytree(trained, target)

    start_worker("control")
    start_worker("rollout,train")
    start_worker("verify")
    for version in (v0, v1):
        response = api.post(f"/api/v1/policy-versions/{version.pk}/evaluate/", {}, format="json")
        assert response.status_code == 202, response.content
    deadline = time.monotonic() + 300
    while Evaluation.objects.filter(version__run=run, status=Evaluation.Status.DONE).count() < 4:
        assert time.monotonic() < deadline, list(Evaluation.objects.values_list("version__number", "domain__name",
                                                                               "status"))
        time.sleep(1)

    body = api.get(f"/api/v1/policy-versions/{v1.pk}/compare/?against=base").json()
    rows = {d["domain"]: d for d in body["domains"]}
    assert rows["addition"]["score"] < rows["addition"]["baseline"] - 0.05, rows
    assert body["regressions"] == ["addition"], json.dumps(body)[:3000]
    assert rows["addition"]["paired_tasks"] == 1000 and rows["addition"]["ci95"][1] < 0
    assert not rows["multiplication"]["regression"]
    refused = api.post(f"/api/v1/policy-versions/{v1.pk}/promote/", {"alias": "production"}, format="json")
    assert refused.status_code == 409 and "addition regressed" in refused.json()["detail"]
