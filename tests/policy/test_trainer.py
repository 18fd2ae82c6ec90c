"""The trainer: what a step changes, what it drops, what it reports, and collapse detection."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from workers.policy.demo_model import demo_tasks
from workers.policy.engines import Sample, SamplingParams
from workers.policy.torch_engine import TorchEngine
from workers.policy.trainer import Group, Trainer, TrainerConfig


def _groups(demo_dir: Path, n_prompts: int = 4, g: int = 4, seed: int = 0) -> list[Group]:
    engine = TorchEngine(demo_dir, seed=seed)
    prompts = [r["prompt"] for r in demo_tasks("addition", n_prompts, seed=seed)]
    samples = engine.generate(prompts, SamplingParams(n=g, temperature=1.0, max_tokens=5))
    # Alternating rewards guarantee variance in every group, so every group trains.
    return [
        Group(samples=samples[i * g : (i + 1) * g], rewards=[float(j % 2) for j in range(g)])
        for i in range(n_prompts)
    ]


def _snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}


def test_lora_step_changes_adapter_and_nothing_else(demo_dir: Path) -> None:
    trainer = Trainer(demo_dir, TrainerConfig(lr=1e-2, num_minibatches=2))
    before = _snapshot(trainer)
    metrics = trainer.train_step(_groups(demo_dir))
    assert metrics.updated and not metrics.collapsed
    after = _snapshot(trainer)
    lora = [k for k in before if "lora_" in k]
    assert lora and all(("lora_" in k) == trainer.model.get_parameter(k).requires_grad for k in before)
    # Two optimizer updates: B moves first, then A (its gradient is zero while B is zero).
    unchanged_lora = [k for k in lora if torch.equal(before[k], after[k])]
    assert not unchanged_lora
    changed_base = [k for k in before if "lora_" not in k and not torch.equal(before[k], after[k])]
    assert not changed_base


def test_full_finetune_step_changes_every_parameter(demo_dir: Path) -> None:
    trainer = Trainer(demo_dir, TrainerConfig(lr=1e-3, lora_rank=0, num_minibatches=1))
    before = _snapshot(trainer)
    trainer.train_step(_groups(demo_dir))
    after = _snapshot(trainer)
    assert [k for k in before if torch.equal(before[k], after[k])] == []


def test_metrics_on_policy(demo_dir: Path) -> None:
    trainer = Trainer(demo_dir, TrainerConfig(num_minibatches=1, micro_batch_size=5))
    groups = _groups(demo_dir)
    m = trainer.train_step(groups)
    tokens = sum(len(s.completion_token_ids) for g in groups for s in g.samples)
    assert m.tokens_trained == tokens and m.samples_trained == 16 and m.groups_used == 4
    # Samples came from the same weights: importance weights are 1 and nothing is clipped on one update.
    assert m.iw_mean == pytest.approx(1.0, abs=1e-3) and m.iw_max == pytest.approx(1.0, abs=1e-3)
    assert m.kl == pytest.approx(0.0, abs=1e-5)
    assert m.clip_fraction == 0.0
    assert m.entropy > 0 and m.grad_norm > 0 and math.isfinite(m.loss)
    assert m.reward_mean == pytest.approx(0.5)


def test_stale_samples_get_importance_weights_and_kl_penalty(demo_dir: Path) -> None:
    groups = _groups(demo_dir)
    for g in groups:  # pretend an older policy sampled these, with lower probabilities
        g.samples = [
            Sample(
                s.prompt,
                s.prompt_token_ids,
                s.completion_token_ids,
                s.text,
                [lp - 0.1 for lp in s.logprobs],
                s.finish_reason,
                s.version,
            )
            for s in g.samples
        ]
    trainer = Trainer(demo_dir, TrainerConfig(num_minibatches=2, kl_coef=0.1, lr=1e-2))
    m = trainer.train_step(groups)
    assert m.iw_mean == pytest.approx(math.exp(0.1), abs=1e-3)
    assert m.kl > 0
    assert m.kl_ref >= 0 and m.updated


def test_drops_invalid_verdicts_and_zero_variance_groups(demo_dir: Path) -> None:
    groups = _groups(demo_dir)
    groups[0].rewards = [1.0, 1.0, 1.0, 1.0]  # zero variance
    groups[1].rewards = [None, 1.0, None, None]  # one valid sample left: no baseline
    groups[2].rewards = [None, 1.0, 0.0, 1.0]  # trains on three
    trainer = Trainer(demo_dir, TrainerConfig(num_minibatches=1))
    m = trainer.train_step(groups)
    assert m.groups_dropped_zero_variance == 2
    assert m.samples_dropped_invalid == 4
    assert m.groups_used == 2 and m.samples_trained == 7


def test_collapse_reported_after_identical_rewards(demo_dir: Path) -> None:
    groups = _groups(demo_dir, n_prompts=2)
    for g in groups:
        g.rewards = [0.0] * len(g.samples)
    trainer = Trainer(demo_dir, TrainerConfig(collapse_patience=3))
    results = [trainer.train_step(groups) for _ in range(3)]
    assert [m.collapsed for m in results] == [False, False, True]
    assert not any(m.updated for m in results)
    assert "identical" in (results[-1].collapse_reason or "")


def test_nonfinite_loss_is_reported_and_skipped(demo_dir: Path) -> None:
    groups = _groups(demo_dir, n_prompts=2)
    s = groups[0].samples[0]
    nan_sample = Sample(
        s.prompt,
        s.prompt_token_ids,
        s.completion_token_ids,
        s.text,
        [float("nan")] * len(s.logprobs),
        s.finish_reason,
        s.version,
    )
    groups[0].samples = [nan_sample, *groups[0].samples[1:]]
    trainer = Trainer(demo_dir, TrainerConfig(num_minibatches=1, iw_cap=None))
    before = _snapshot(trainer)
    m = trainer.train_step(groups)
    assert m.collapsed and "non-finite" in (m.collapse_reason or "")
    assert not m.updated
    assert all(torch.equal(v, trainer.model.get_parameter(k)) for k, v in before.items())


def test_saved_version_is_served_by_engine(demo_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(demo_dir, TrainerConfig(lr=1e-2))
    trainer.train_step(_groups(demo_dir))
    meta = trainer.save_version(tmp_path / "v1")
    assert (meta.version, meta.parent, meta.step, meta.kind) == (1, 0, 1, "lora")
    engine = TorchEngine(demo_dir)
    engine.set_version(tmp_path / "v1")
    out = engine.generate(["12+34="], SamplingParams(temperature=0.0, max_tokens=4))
    assert out[0].version == 1
    # The trainer's model and the engine agree on the next-token distribution.
    ids = torch.tensor([out[0].prompt_token_ids])
    with torch.no_grad():
        a = trainer.model.eval()(input_ids=ids).logits
        b = engine.model(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # A trainer resumed from that version holds the same weights and continues the numbering.
    resumed = Trainer(demo_dir, TrainerConfig(), version_dir=tmp_path / "v1")
    assert (resumed.version, resumed.step) == (1, 1)
    with torch.no_grad():
        c = resumed.model.eval()(input_ids=ids).logits
    torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_advantages_from_the_batch_side_are_what_the_trainer_uses(demo_dir: Path) -> None:
    """Advantages computed where the batch is assembled drive the step exactly as if the trainer had
    computed them: same estimator, same update; and the trainer does not second-guess them."""
    from workers.policy.losses import sample_advantages

    groups = _groups(demo_dir)
    given = [Group(g.samples, g.rewards, sample_advantages(list(g.rewards), "grpo")) for g in groups]
    a = Trainer(demo_dir, TrainerConfig(lr=1e-2, num_minibatches=1, seed=3))
    b = Trainer(demo_dir, TrainerConfig(lr=1e-2, num_minibatches=1, seed=3))
    a.train_step(groups)
    b.train_step(given)
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-7), name
    # advantages the batch side chose (here: the opposite sign) are the ones trained on
    flipped = [Group(g.samples, g.rewards, [-x for x in sample_advantages(list(g.rewards))]) for g in groups]
    c = Trainer(demo_dir, TrainerConfig(lr=1e-2, num_minibatches=1, seed=3))
    c.train_step(flipped)
    assert any(not torch.allclose(pa, pc) for pa, pc in zip(a.model.parameters(), c.model.parameters(), strict=True))


def test_loss_aggregation_is_chosen_by_name(demo_dir: Path) -> None:
    """token_mean weighs every token alike; sequence_mean every sequence alike: on sequences of different
    lengths the two updates differ, and each one trains."""
    groups = _groups(demo_dir)
    lengths = {len(s.completion_token_ids) for g in groups for s in g.samples}
    assert len(lengths) > 1, "the samples need different lengths for the aggregations to differ"
    params = {}
    for how in ("token_mean", "sequence_mean"):
        trainer = Trainer(demo_dir, TrainerConfig(lr=1e-2, num_minibatches=1, seed=3, loss_aggregation=how))
        metrics = trainer.train_step(groups)
        assert metrics.updated
        params[how] = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
    assert any(not torch.allclose(x, y) for x, y in zip(params["token_mean"], params["sequence_mean"], strict=True))


def test_the_trainer_says_which_samples_were_clipped(demo_dir: Path) -> None:
    """A sample is clipped when any of its tokens hit the PPO clip: the later minibatches of a step see a
    policy already moved by the earlier ones (the first minibatch's ratio is exactly 1: never clipped)."""
    groups = _groups(demo_dir, n_prompts=8)
    trainer = Trainer(demo_dir, TrainerConfig(lr=5e-2, num_minibatches=4, clip_low=0.01, clip_high=0.01))
    metrics = trainer.train_step(groups)
    assert metrics.clip_fraction > 0 and metrics.clipped_samples
    keys = {(gi, si) for gi, g in enumerate(groups) for si in range(len(g.samples))}
    assert set(metrics.clipped_samples) <= keys and len(set(metrics.clipped_samples)) < len(keys)
