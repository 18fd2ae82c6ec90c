"""A multi-turn domain through the real loop: episodes of the python_tool environment generated on the GPU
worker in sandbox sessions, stored with their turns, scored on the verify queue from the stored transcript,
and trained on their sampled tokens only (real Redis, real Celery workers, the torch engine).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests import factories
from tests.test_pipeline import wait_status
from webapp.catalog.models import BaseModel, TaskDomain
from webapp.catalog.services import do_import_tasks
from webapp.runs.loop.accounting import accounting
from webapp.runs.loop.training import loss_mask
from webapp.runs.models import PromptGroup, Trajectory
from workers.environments.base import Turn
from workers.environments.episodes import check_invariants

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def stored_episode_problems(t: Trajectory, decode: Any) -> list[str]:
    """What breaks the token invariants of a stored episode, with the loss mask the trainer builds from it."""
    turns = [Turn.from_dict(d) for d in t.turns]
    mask = loss_mask(t.turns, len(t.completion_token_ids)) or []
    return check_invariants(t.prompt_token_ids, t.completion_token_ids, mask, turns,
                            lambda ids: decode(ids, skip_special_tokens=True))

SPEC = {
    "algorithm": {"learning_rate": 1e-3, "lora_rank": 8, "updates_per_batch": 1},
    "pipeline": {"group_size": 4, "batch_prompts": 2, "max_staleness": 1, "rollout_batch_prompts": 2},
    "sampling": {"temperature": 1.0, "max_tokens": 10},
    "episode": {"max_turns": 3, "tool_seconds": 1.0},
    "max_steps": 2, "eval_every": 2, "eval_tasks": 4,
}


def test_a_python_tool_domain_trains_on_episodes_whose_invariants_hold(start_worker, api, user):
    from workers.policy.engines import load_engine

    start_worker("control")
    start_worker("rollout,train")
    start_worker("verify")
    verifier = factories.verifier(user, name="exact")
    domain = TaskDomain.objects.create(owner=user, name="mul-tool", kind="answer", verifier=verifier,
                                       environment="python_tool")
    rows = [{"prompt": f"{a}*{b}=", "answer": a * b, "split": "heldout" if a == 19 else "train"}
            for a in range(12, 20) for b in (13, 27)]
    rows += [{"prompt": f"{a}*{b}=", "answer": a * b, "split": "heldout"} for a in (21, 22) for b in (31, 41)]
    do_import_tasks(domain, (json.dumps(r) for r in rows))
    bm = BaseModel.objects.create(owner=user, name="demo", path="assets/base-models/demo")
    response = api.post("/api/v1/runs/", {"name": "tool", "base_model": bm.pk, "domains": [{"domain": domain.pk}],
                                          "spec": SPEC}, format="json")
    assert response.status_code == 201, response.content
    run_id = response.json()["id"]
    assert api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json").status_code == 200
    run = wait_status(run_id, {"completed"}, timeout=240)
    assert run.step == 2 and not accounting(run).problems
    trained = PromptGroup.objects.filter(run=run, status="trained").values("key")
    episodes = list(Trajectory.objects.filter(run=run, group_key__in=trained))
    assert len(episodes) == 2 * 2 * 4
    decode = load_engine("torch", "assets/base-models/demo").tokenizer.decode
    for t in episodes:
        turns = [Turn.from_dict(d) for d in t.turns]
        assert turns and turns[0].role == "model" and t.stop_reason in ("done", "max_turns", "context")
        assert not (problems := stored_episode_problems(t, decode)), (t.pk, problems)
        assert len(t.behaviour_logprobs) == len(t.completion_token_ids)
        assert t.verdict in ("pass", "fail"), (t.verdict, t.verdict_reason)  # scored from the transcript
        assert t.completion == turns[[i for i, x in enumerate(turns) if x.role == "model"][-1]].text
    # each step reported the episodes' own metrics, per domain
    from webapp.runs.models import MetricPoint

    names = set(MetricPoint.objects.filter(run=run, domain=domain).values_list("name", flat=True))
    assert {"turns_mean", "tool_call_rate", "env_token_share"} <= names
    token_lag = list(MetricPoint.objects.filter(run=run, name="staleness_token_mean").values_list("value", flat=True))
    assert len(token_lag) == 2 and all(0 <= v <= 1 for v in token_lag)  # max_staleness 1 bounds it
    assert any(n.startswith("stop_") for n in names)
    # the API returns the turns, the page shows them as a transcript
    body = api.get(f"/api/v1/trajectories/{episodes[0].pk}/").json()
    assert body["turns"] == episodes[0].turns and body["stop_reason"] == episodes[0].stop_reason
    from django.test import Client

    client = Client()
    client.force_login(user)
    page = client.get(f"/trajectories/{episodes[0].pk}/").content.decode()
    assert 'id="transcript"' in page and "(trained on)" in page
    # held-out evaluation plays whole episodes too (greedy turns), scored from their transcripts
    from webapp.runs.models import Evaluation

    wait_until = time.monotonic() + 120
    while (Evaluation.objects.filter(version__run=run, domain=domain, status="done").count() < 2
           and time.monotonic() < wait_until):
        time.sleep(0.5)
    evaluations = list(Evaluation.objects.filter(version__run=run, domain=domain, status="done"))
    assert sorted(e.version.number for e in evaluations) == [0, 2] and all(e.n_tasks == 4 for e in evaluations)
    evaluated = list(Trajectory.objects.filter(run=run, is_eval=True, domain=domain))
    assert len(evaluated) == 8 and all(t.turns and t.stop_reason for t in evaluated)
    assert all(t.verdict in ("pass", "fail") for t in evaluated), [(t.verdict, t.verdict_reason) for t in evaluated]
    for t in evaluated:
        assert not (problems := stored_episode_problems(t, decode)), (t.pk, problems)
