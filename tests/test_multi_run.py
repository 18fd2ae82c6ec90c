"""Several runs at once: two runs on one base model, one GPU worker, each sampling only from its own policy.

The proof is in the numbers each sample carries: its behaviour log-probs are recomputed under the run's own
version and under the other run's version of the same number. They match the former and not the latter.
Real Redis, real Celery workers, the torch engine; the GPU worker's memory budget is set small enough that
engines and trainers are also evicted and rebuilt along the way.
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from tests import factories
from tests.test_pipeline import assert_counts_add_up, wait_status
from webapp.catalog.models import BaseModel, TaskDomain
from webapp.catalog.services import do_import_tasks
from webapp.runs.loop import paths
from webapp.runs.models import Trajectory

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SPEC = {
    "algorithm": {"learning_rate": 2e-3, "lora_rank": 8, "updates_per_batch": 1},
    "pipeline": {"group_size": 4, "batch_prompts": 4, "max_staleness": 1, "rollout_batch_prompts": 4},
    "sampling": {"temperature": 1.0, "max_tokens": 5, "stop": ["\n"]},
    "max_steps": 5, "eval_every": 0,
}


def recomputed(version_dir, samples) -> list[list[float]]:
    """Log-probs of each sample's completion tokens under the version in ``version_dir`` (temperature 1)."""
    from workers.policy import versions
    from workers.policy.losses import token_logprobs

    base = paths.resolve_model_path(BaseModel(path="assets/base-models/demo"))
    model = versions.load_version(base, version_dir)
    out = []
    with torch.no_grad():
        for t in samples:
            ids = torch.tensor([t.prompt_token_ids + t.completion_token_ids])
            logits = model(input_ids=ids).logits[:, len(t.prompt_token_ids) - 1:-1]
            out.append(token_logprobs(logits, torch.tensor([t.completion_token_ids])).tolist()[0])
    return out


def mean_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return statistics.fmean(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_two_runs_on_one_base_model_and_one_gpu_worker_sample_their_own_policies(start_worker, api, user):
    from workers.policy.demo_model import _split_pool

    start_worker("control")
    start_worker("rollout,train", TEMPER_RESIDENT_MB="12")  # room for an engine and one trainer, not two
    start_worker("verify")
    verifier = factories.verifier(user, name="exact")
    domain = TaskDomain.objects.create(owner=user, name="addition", kind="answer", verifier=verifier)
    rows = [{"prompt": p, "answer": a, "split": "train"} for p, a in _split_pool("addition", "train")[:60]]
    do_import_tasks(domain, (json.dumps(r) for r in rows))
    bm = BaseModel.objects.create(owner=user, name="demo", path="assets/base-models/demo")
    ids = []
    for name, seed in (("a", 1), ("b", 2)):
        response = api.post("/api/v1/runs/", {"name": name, "base_model": bm.pk, "domains": [{"domain": domain.pk}],
                                              "spec": {**SPEC, "seed": seed}}, format="json")
        assert response.status_code == 201, response.content
        ids.append(response.json()["id"])
    for run_id in ids:
        assert api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json").status_code == 200
    runs = [wait_status(run_id, {"completed"}, timeout=300) for run_id in ids]
    for run in runs:
        assert_counts_add_up(run)
    a, b = runs
    checked = 0
    for own, other in ((a, b), (b, a)):
        for number in (1, 2, 3):
            samples = list(Trajectory.objects.filter(run=own, is_eval=False, version=number)
                           .exclude(completion_token_ids=[])[:12])
            if not samples:
                continue
            behaviour = [t.behaviour_logprobs for t in samples]
            under_own = recomputed(paths.version_dir(own.pk, number), samples)
            under_other = recomputed(paths.version_dir(other.pk, number), samples)
            own_gap, other_gap = mean_gap(behaviour, under_own), mean_gap(behaviour, under_other)
            # the sampled tokens' log-probs are the run's own policy's (float noise only), not the other's
            assert own_gap < 2e-3, (own.name, number, own_gap)
            assert other_gap > 10 * max(own_gap, 1e-4), (own.name, number, own_gap, other_gap)
            checked += 1
    assert checked >= 4, "too few samples generated under versions 1 to 3 to compare"
