"""Chat models: a task is messages (system prompt, user turn; tool and user turns in episodes) rendered by the
base model's chat template, one appended message at a time, token-in/token-out; on a tiny model with a
template (``tests/chat_model.py``), through the episode runner and through the real loop.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sandboxes.session import SessionLimits, SessionPool, SessionSpec
from tests import factories
from tests.chat_model import CHATML_LIKE, DEMO, NO_TOOL_ROLE, RE_RENDERS, make_chat_model
from workers.environments.base import EnvTask, make_environment
from workers.environments.episodes import (
    Episode,
    EpisodeLimits,
    Generated,
    check_invariants,
    engine_io,
    run_episodes,
)
from workers.policy.chat import ChatFormat, ChatTemplateError, apply_override, prompt_text, task_messages
from workers.policy.engines import load_engine
from workers.verifiers.base import JudgeInput, build_verifier


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("chat") / "model")


def template_ids(tok, messages) -> list[int]:
    """What the template makes of the whole conversation (rendered as text, then tokenized)."""
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


def tokenizer_with(template: str | None):
    tok = AutoTokenizer.from_pretrained(DEMO)
    apply_override(tok, template)
    return tok


def test_a_conversation_rendered_a_message_at_a_time_is_the_template_on_the_whole_history():
    tok = tokenizer_with(CHATML_LIKE)
    chat = ChatFormat(tok)
    first = task_messages("Use the tool.", "What is 12*34?")
    ids = chat.prompt_ids(first)
    assert ids == template_ids(tok, first)
    assert tok.decode(ids) == "<|system|>Use the tool.<|endoftext|><|user|>What is 12*34?<|endoftext|><|assistant|>"
    # turn 1 stopped on a stop string (no end-of-turn token: the observation closes it); turn 2 ended itself
    call = tok.encode("<py>print(12*34)</py>", add_special_tokens=False)
    ids += call + chat.observation_ids("tool", "<out>408</out>", call)
    answer = [*tok.encode("Answer: 408", add_special_tokens=False), tok.eos_token_id]
    ids += answer + chat.observation_ids("user", "Are you sure?", answer)
    whole = [*first, {"role": "assistant", "content": "<py>print(12*34)</py>"},
             {"role": "tool", "content": "<out>408</out>"}, {"role": "assistant", "content": "Answer: 408"},
             {"role": "user", "content": "Are you sure?"}]
    assert ids == template_ids(tok, whole)


def test_without_a_template_a_prompt_is_its_text_and_an_observation_is_appended_as_it_is():
    tok = tokenizer_with(None)
    chat = ChatFormat(tok)
    assert not chat.templated
    assert chat.prompt_ids(task_messages("Be brief.", "1+2=")) == tok.encode("Be brief.\n\n1+2=")
    assert chat.prompt_ids("1+2=") == tok.encode("1+2=")  # what a plain prompt always was
    assert chat.observation_ids("tool", "<out>3</out>\n", [5]) == tok.encode("<out>3</out>\n", add_special_tokens=False)
    assert prompt_text(task_messages("", "1+2=")) == "1+2="


def test_a_template_without_a_tool_role_gets_tool_results_as_user_messages():
    tok = tokenizer_with(NO_TOOL_ROLE)
    obs = ChatFormat(tok).observation_ids("tool", "<out>4</out>", [tok.eos_token_id])
    assert tok.decode(obs) == "<|user|><out>4</out><|endoftext|><|assistant|>"


def test_a_template_that_re_renders_the_history_is_refused_with_the_reason():
    chat = ChatFormat(tokenizer_with(RE_RENDERS))
    with pytest.raises(ChatTemplateError, match="renders earlier messages differently"):
        chat.observation_ids("tool", "<out>4</out>", [])


def test_an_episode_of_a_chat_model_trains_on_sampled_tokens_only_not_on_the_template(chat_dir):
    engine = load_engine("torch", chat_dir, seed=0)
    tok = engine.tokenizer
    io = engine_io(engine)
    replies = ["<py>print(6*7)</py>", "Answer: 42"]

    def generate(contexts, max_tokens, stop):
        out = []
        for context in contexts:
            k = io.decode(context).count("<out>")
            ids = tok.encode(replies[min(k, 1)], add_special_tokens=False) + ([tok.eos_token_id] if k else [])
            out.append(Generated(ids, [-0.5] * len(ids), "stop", 3))
        return out

    verifier = build_verifier("exact_match", {"extract": "marker"})
    env = make_environment("python_tool", {}, lambda task, text: verifier.judge(
        JudgeInput(task.prompt, text, {"answer": "42"})))
    with SessionPool() as pool:
        session = pool.open(SessionSpec(limits=SessionLimits(cell_wall_seconds=2.0)))
        ep = Episode(env=env, task=EnvTask(prompt="What is 6*7?", reference={"answer": "42"}, system="Use Python."),
                     session=session)
        run_episodes([ep], io.__class__(generate, io.prompt_ids, io.observation_ids, io.decode), EpisodeLimits())
        session.close()
    assert ep.stop_reason == "done" and [t.role for t in ep.turns] == ["model", "env", "model"]
    assert tok.decode(ep.prompt_ids) == "<|system|>Use Python.<|endoftext|><|user|>What is 6*7?<|endoftext|><|assistant|>"
    obs = ep.turns[1]
    # the observation's span holds the template's framing: the closing of the model's turn, the tool message,
    # the next generation prompt; none of it is trained on
    assert tok.decode(ep.completion_ids[obs.start:obs.end]) == "<|endoftext|><|tool|><out>42</out>\n<|endoftext|><|assistant|>"
    assert set(ep.mask[obs.start:obs.end]) == {0}
    assert sum(ep.mask) == len(tok.encode("<py>print(6*7)</py>Answer: 42", add_special_tokens=False)) + 1
    assert not check_invariants(ep.prompt_ids, ep.completion_ids, ep.mask, ep.turns, io.decode)
    assert env.score(ep.transcript).status == "pass"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_run_on_a_registered_chat_template_renders_the_system_prompt_and_tool_turns_as_messages(
        start_worker, api, user):
    from tests.test_episodes_loop import stored_episode_problems
    from tests.test_pipeline import wait_status
    from webapp.catalog.models import BaseModel, TaskDomain
    from webapp.catalog.services import do_import_tasks
    from webapp.runs.models import Trajectory

    start_worker("control")
    start_worker("rollout,train")
    start_worker("verify")
    verifier = factories.verifier(user, name="exact")
    tool = TaskDomain.objects.create(owner=user, name="mul-tool", kind="answer", verifier=verifier,
                                     environment="python_tool", system_prompt="Use Python.")
    plain = TaskDomain.objects.create(owner=user, name="add", kind="answer", verifier=verifier,
                                      system_prompt="Be brief.")
    for domain, op in ((tool, "*"), (plain, "+")):
        rows = [{"prompt": f"{a}{op}{b}=", "answer": eval(f"{a}{op}{b}"), "split": "heldout" if a == 19 else "train"}
                for a in range(12, 20) for b in (13, 27)]
        do_import_tasks(domain, (json.dumps(r) for r in rows))
    # the demo model's own tokenizer has no template: the registered one is what the run must use
    bm = BaseModel.objects.create(owner=user, name="demo-chat", path="assets/base-models/demo", chat_template=CHATML_LIKE)
    spec = {"algorithm": {"learning_rate": 1e-3, "lora_rank": 8}, "sampling": {"temperature": 1.0, "max_tokens": 10},
            "pipeline": {"group_size": 2, "batch_prompts": 2, "max_staleness": 1, "rollout_batch_prompts": 2},
            "episode": {"max_turns": 2, "tool_seconds": 1.0}, "max_steps": 2, "eval_every": 2, "eval_tasks": 2}
    response = api.post("/api/v1/runs/", {"name": "chat", "base_model": bm.pk, "spec": spec,
                                          "domains": [{"domain": tool.pk}, {"domain": plain.pk}]}, format="json")
    assert response.status_code == 201, response.content
    run_id = response.json()["id"]
    assert api.post(f"/api/v1/runs/{run_id}/start/", {}, format="json").status_code == 200
    run = wait_status(run_id, {"completed"}, timeout=240)
    assert run.step == 2
    tok = tokenizer_with(CHATML_LIKE)
    rows = list(Trajectory.objects.filter(run=run))
    for domain, system in ((tool, "Use Python."), (plain, "Be brief.")):
        mine = [t for t in rows if t.domain_id == domain.pk]
        assert mine, domain.name
        for t in mine:
            user_turn = t.task.domain.render_prompt(t.task.prompt, t.task.reference, with_system=False)
            assert t.prompt_token_ids == template_ids(tok, task_messages(system, user_turn))
            assert t.prompt == f"{system}\n\n{user_turn}"
    episodes = [t for t in rows if t.domain_id == tool.pk and any(x["role"] == "env" for x in t.turns)]
    for t in episodes:
        assert not (problems := stored_episode_problems(t, tok.decode)), problems
        first_obs = next(x for x in t.turns if x["role"] == "env")
        assert "<|tool|>" in tok.decode(t.completion_token_ids[first_obs["start"]:first_obs["end"]])
