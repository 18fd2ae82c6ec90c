"""Multi-turn environments: episodes run token-in/token-out in real sandbox sessions, limits that end episodes,
rewards that come from what the environment holds, and a loss mask that trains on sampled tokens only.

The policy is either the demo model through the torch engine, or a *scripted* policy: a generate function
that answers each turn with fixed text through the real tokenizer (a stand-in for a model that already
knows the tool, so that every path of an episode is reached on purpose).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from sandboxes.session import SessionLimits, SessionPool, SessionSpec
from workers.environments.base import EnvTask, make_environment, validate_params
from workers.environments.episodes import (
    Episode,
    EpisodeLimits,
    Generated,
    TokenIO,
    check_invariants,
    engine_io,
    run_episodes,
)
from workers.policy.engines import Sample, SamplingParams, load_engine
from workers.policy.trainer import Group, Trainer, TrainerConfig
from workers.verifiers.base import JudgeInput, build_verifier

DEMO = Path(__file__).resolve().parent.parent / "assets" / "base-models" / "demo"


@pytest.fixture(scope="module")
def engine():
    return load_engine("torch", DEMO, seed=0)


@pytest.fixture(scope="module")
def sessions() -> Iterator[SessionPool]:
    with SessionPool() as pool:
        yield pool


def judge_for(answer: str):
    verifier = build_verifier("exact_match", {"extract": "marker"})
    return lambda task, completion: verifier.judge(JudgeInput(task.prompt, completion, {"answer": answer}))


def scripted(engine, replies: list[str]) -> TokenIO:
    """A policy that says ``replies`` in turn, tokenized by the real tokenizer (its k-th reply follows the
    k-th observation of the context)."""
    io = engine_io(engine)

    def generate(contexts, max_tokens, stop):
        out = []
        for context in contexts:
            k = io.decode(context).count("<out>")
            ids = engine.tokenizer.encode(replies[min(k, len(replies) - 1)], add_special_tokens=False)[:max_tokens]
            out.append(Generated(ids, [-0.5] * len(ids), "stop", 7))
        return out

    return replace(io, generate=generate)


FAST_CELLS = SessionLimits(cell_wall_seconds=0.5)


def episode(env_name: str, sessions, prompt: str, answer: str, params=None, limits=FAST_CELLS):
    env = make_environment(env_name, params or {}, judge_for(answer))
    session = sessions.open(SessionSpec(limits=limits)) if env.needs_session else None
    return Episode(env=env, task=EnvTask(prompt=prompt, reference={"answer": answer}), session=session)


def finish(ep: Episode):
    verdict = ep.env.score(ep.transcript) if ep.stop_reason else None
    if ep.session is not None:
        ep.session.close()
    return verdict


def test_single_turn_is_the_degenerate_episode(engine):
    io = engine_io(engine, temperature=0.0)
    ep = Episode(env=make_environment("single_turn", {}, judge_for("46")), task=EnvTask(prompt="12+34="))
    run_episodes([ep], io, EpisodeLimits(max_tokens_per_turn=6))
    assert ep.stop_reason == "done" and [t.role for t in ep.turns] == ["model"]
    assert all(m == 1 for m in ep.mask) and ep.prompt_ids == io.prompt_ids("12+34=")
    assert not check_invariants(ep.prompt_ids, ep.completion_ids, ep.mask, ep.turns, io.decode)
    greedy = engine.generate(["12+34="], SamplingParams(temperature=0.0, max_tokens=6))[0]
    assert ep.completion_ids == greedy.completion_token_ids  # the same tokens the single-turn path samples


def test_a_tool_call_runs_in_the_session_and_its_output_is_an_observation(engine, sessions):
    io = scripted(engine, ["<py>x = 12 * 34\nprint(x)</py>", "Answer: 408"])
    ep = episode("python_tool", sessions, "What is 12*34?", "408")
    run_episodes([ep], io, EpisodeLimits())
    assert [(t.role, t.status) for t in ep.turns] == [("model", "ok"), ("env", "ok"), ("model", "ok")]
    assert ep.turns[1].text == "<out>408</out>\n" and ep.turns[1].tool == "python"
    assert ep.turns[1].args == "x = 12 * 34\nprint(x)"
    assert ep.stop_reason == "done"
    assert not check_invariants(ep.prompt_ids, ep.completion_ids, ep.mask, ep.turns, io.decode)
    # the mask is 1 exactly on the model's own turns
    env_span = ep.turns[1]
    assert set(ep.mask[env_span.start:env_span.end]) == {0} and set(ep.mask[:env_span.start]) == {1}
    assert finish(ep).status == "pass"


def test_a_tool_that_loops_forever_is_a_timeout_observation_and_the_episode_goes_on(engine, sessions):
    io = scripted(engine, ["<py>while True: pass</py>", "<py>print(2+2)</py>", "Answer: 4"])
    ep = episode("python_tool", sessions, "2+2?", "4")
    run_episodes([ep], io, EpisodeLimits())
    statuses = [t.status for t in ep.turns if t.role == "env"]
    assert statuses == ["timeout", "ok"] and ep.stop_reason == "done"
    assert finish(ep).status == "pass"


def test_a_malformed_call_is_an_error_observation_counted_not_an_exception(engine, sessions):
    io = scripted(engine, ["<py>print(1", "Answer: 1"])
    ep = episode("python_tool", sessions, "one?", "1")
    run_episodes([ep], io, EpisodeLimits())
    assert [t.status for t in ep.turns if t.role == "env"] == ["parse_error"]
    assert "not closed" in ep.turns[1].text and ep.stop_reason == "done"
    finish(ep)


def test_a_model_that_writes_a_fake_reward_file_gains_nothing(engine, sessions):
    hack = "<py>open('reward', 'w').write('1.0'); open('score.json', 'w').write('{\"pass\": true}'); print('correct')</py>"
    io = scripted(engine, [hack, "Answer: 7"])
    ep = episode("python_tool", sessions, "What is 6*7?", "42")
    run_episodes([ep], io, EpisodeLimits(max_tokens_per_turn=200))
    assert ep.turns[1].text == "<out>correct</out>\n"
    verdict = finish(ep)
    assert verdict.status == "fail" and verdict.score == 0.0


def test_limits_end_episodes_with_their_reason(engine, sessions):
    io = scripted(engine, ["<py>print(1)</py>"])  # never answers
    ep = episode("python_tool", sessions, "loop", "1")
    run_episodes([ep], io, EpisodeLimits(max_turns=3))
    assert ep.stop_reason == "max_turns" and sum(t.role == "model" for t in ep.turns) == 3
    finish(ep)
    io = scripted(engine, ["<py>print('a' * 40)</py>"])
    tight = episode("python_tool", sessions, "context", "1")
    run_episodes([tight], io, EpisodeLimits(max_turns=50, context_tokens=60))
    assert tight.stop_reason == "context" and len(tight.prompt_ids) + len(tight.completion_ids) <= 60
    assert not check_invariants(tight.prompt_ids, tight.completion_ids, tight.mask, tight.turns, io.decode)
    finish(tight)


def test_real_samples_of_the_demo_model_keep_every_invariant(engine, sessions):
    io = engine_io(engine, temperature=1.0)
    eps = [episode("python_tool", sessions, f"{a}*{b}=", str(a * b)) for a in range(11, 19) for b in (23, 57)]
    run_episodes(eps, io, EpisodeLimits(max_turns=3, max_tokens_per_turn=12,
                                                                             context_tokens=64))
    for ep in eps:
        assert ep.stop_reason is not None
        assert not check_invariants(ep.prompt_ids, ep.completion_ids, ep.mask, ep.turns, io.decode)
        assert ep.versions == [0]
        finish(ep)


def test_environment_params_are_validated():
    assert validate_params("python_tool", {"max_output_chars": 50}).max_output_chars == 50
    with pytest.raises(ValueError, match=r"environment_params\.max_output_chars"):
        validate_params("python_tool", {"max_output_chars": 1})
    with pytest.raises(ValueError, match="unknown environment"):
        validate_params("chess", {})


# ---------------------------------------------------------------- the mask in the trainer


def masked_groups(seed: int = 0, garbage: float | None = None):
    """Two groups of episodes: a sampled turn, an observation (mask 0), another sampled turn."""
    torch.manual_seed(seed)
    groups = []
    for g in range(2):
        samples = []
        for i in range(4):
            model1, obs, model2 = [30 + i, 31, 32], [40 + g, 41], [50, 51 + i]
            mask = [1] * 3 + [0] * 2 + [1] * 2
            logprobs = [-1.0, -1.1, -1.2] + [garbage if garbage is not None else 0.0] * 2 + [-0.9, -0.8]
            samples.append(Sample("p", [5, 6, 7], model1 + obs + model2, "", logprobs, "stop", 0, mask=mask))
        groups.append(Group(samples, [float(i % 2) for i in range(4)]))
    return groups


def test_the_gradient_on_tokens_the_policy_did_not_sample_is_exactly_zero():
    trainer = Trainer(DEMO, TrainerConfig(lr=1e-2, num_minibatches=1, micro_batch_size=64))
    captured = {}
    original = trainer._completion_logits

    def keep(model, batch):
        logits = original(model, batch)
        if logits.requires_grad:  # the training pass (the proximal log-probs are computed without a graph)
            logits.retain_grad()
            captured["logits"], captured["mask"] = logits, batch["mask"]
        return logits

    trainer._completion_logits = keep  # type: ignore[method-assign]
    trainer.train_step(masked_groups())
    grad, mask = captured["logits"].grad, captured["mask"]
    assert grad is not None
    assert torch.count_nonzero(grad[mask == 0]) == 0  # exactly zero, not small
    assert torch.count_nonzero(grad[mask == 1]) > 0


def test_what_is_recorded_for_observation_tokens_does_not_change_the_update():
    updated = []
    for garbage in (0.0, -1e4, 80.0):
        trainer = Trainer(DEMO, TrainerConfig(lr=1e-2, num_minibatches=1, seed=1))
        metrics = trainer.train_step(masked_groups(garbage=garbage))
        assert all(v == v for v in (metrics.loss, metrics.kl, metrics.iw_mean))  # no NaN from them either
        assert metrics.tokens_trained == 2 * 4 * 5  # model tokens only
        updated.append([p.detach().clone() for p in trainer.model.parameters() if p.requires_grad])
    for other in updated[1:]:
        assert all(torch.equal(a, b) for a, b in zip(updated[0], other, strict=True))
