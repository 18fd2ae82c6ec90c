"""Each pure function of workers.policy.losses against a slow, loop-based reference."""

from __future__ import annotations

import math

import pytest
import torch

from workers.policy import losses


def _rewards(n: int = 5, g: int = 6, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, (n, g), generator=gen).float() / 2


def _ref_advantages(rows: list[list[float]], kind: str, eps: float) -> list[list[float]]:
    out = []
    for row in rows:
        g = len(row)
        mean = sum(row) / g
        if kind == "grpo":
            var = sum((r - mean) ** 2 for r in row) / (g - 1)
            out.append([(r - mean) / (math.sqrt(var) + eps) for r in row])
        elif kind == "dr_grpo":
            out.append([r - mean for r in row])
        else:
            out.append([r - sum(row[j] for j in range(g) if j != i) / (g - 1) for i, r in enumerate(row)])
    return out


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_match_reference(kind: str) -> None:
    rewards = _rewards()
    got = losses.group_advantages(rewards, kind, eps=1e-6)  # type: ignore[arg-type]
    want = torch.tensor(_ref_advantages(rewards.tolist(), kind, 1e-6))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_zero_variance_group_has_zero_advantage() -> None:
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0]])
    for kind in ("grpo", "dr_grpo", "rloo"):
        adv = losses.group_advantages(rewards, kind)
        assert torch.all(adv[0] == 0)
        assert adv[1].abs().sum() > 0


def test_group_advantages_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="N, G"):
        losses.group_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="unknown"):
        losses.group_advantages(torch.zeros(2, 2), "ppo")  # type: ignore[arg-type]


def _random_logits(b: int = 3, t: int = 4, v: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, v, generator=gen) * 2, torch.randint(0, v, (b, t), generator=gen)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_entropy_match_reference(temperature: float) -> None:
    logits, tokens = _random_logits()
    lp = losses.token_logprobs(logits, tokens, temperature)
    ent = losses.entropy_from_logits(logits, temperature)
    b, t, _v = logits.shape
    for i in range(b):
        for j in range(t):
            row = [x / temperature for x in logits[i, j].tolist()]
            z = math.log(sum(math.exp(x) for x in row))
            assert lp[i, j].item() == pytest.approx(row[tokens[i, j]] - z, abs=1e-5)
            probs = [math.exp(x - z) for x in row]
            assert ent[i, j].item() == pytest.approx(-sum(p * math.log(p) for p in probs), abs=1e-5)


def test_kl_k3_matches_reference_and_is_nonnegative() -> None:
    gen = torch.Generator().manual_seed(2)
    logp, logp_ref = -torch.rand(4, 5, generator=gen) * 3, -torch.rand(4, 5, generator=gen) * 3
    got = losses.kl_k3(logp, logp_ref)
    for i in range(4):
        for j in range(5):
            d = logp_ref[i, j].item() - logp[i, j].item()
            assert got[i, j].item() == pytest.approx(math.exp(d) - d - 1, abs=1e-6)
    assert torch.all(got >= 0)
    assert torch.all(losses.kl_k3(logp, logp) == 0)


def _ref_ppo(
    logp: list[float],
    prox: list[float],
    behav: list[float],
    adv: float,
    lo: float,
    hi: float,
    cap: float | None,
) -> tuple[list[float], list[bool], list[float]]:
    out, clipped, weights = [], [], []
    for lp, px, bh in zip(logp, prox, behav, strict=True):
        w = math.exp(px - bh)
        if cap is not None:
            w = min(w, cap)
        r = math.exp(lp - px)
        rc = min(max(r, 1 - lo), 1 + hi)
        out.append(-w * min(r * adv, rc * adv))
        clipped.append(rc * adv < r * adv)
        weights.append(w)
    return out, clipped, weights


@pytest.mark.parametrize(("lo", "hi", "cap"), [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 1.5)])
def test_decoupled_ppo_clip_matches_reference(lo: float, hi: float, cap: float | None) -> None:
    gen = torch.Generator().manual_seed(3)
    b, t = 6, 5
    behav = -torch.rand(b, t, generator=gen) * 2
    prox = behav + torch.randn(b, t, generator=gen) * 0.3
    logp = (prox + torch.randn(b, t, generator=gen) * 0.4).requires_grad_(True)
    adv = torch.randn(b, generator=gen)
    loss, clipped, weight = losses.decoupled_ppo_clip(logp, prox, behav, adv, lo, hi, cap)
    for i in range(b):
        want, want_clipped, want_w = _ref_ppo(
            logp[i].tolist(), prox[i].tolist(), behav[i].tolist(), adv[i].item(), lo, hi, cap
        )
        assert loss[i].tolist() == pytest.approx(want, abs=1e-5)
        assert clipped[i].tolist() == want_clipped
        assert weight[i].tolist() == pytest.approx(want_w, abs=1e-5)
    assert clipped.any() and not clipped.all()


def test_decoupled_ppo_clip_gradient() -> None:
    """Gradient flows only through unclipped tokens, scaled by the (constant) importance weight."""
    prox = torch.tensor([[-1.0, -1.0]])
    behav = torch.tensor([[-1.5, -1.0]])
    logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)  # ratio 1 (inside) and e^0.5 (outside, clipped)
    adv = torch.tensor([2.0])
    loss, clipped, weight = losses.decoupled_ppo_clip(logp, prox, behav, adv, 0.2, 0.2)
    loss.sum().backward()
    assert logp.grad is not None
    # d/dlogp of -w * r * A at r = 1 is -w * A
    assert logp.grad[0, 0].item() == pytest.approx(-math.exp(0.5) * 2.0, abs=1e-5)
    assert logp.grad[0, 1].item() == 0.0
    assert clipped.tolist() == [[False, True]]
    assert weight[0, 0].item() == pytest.approx(math.exp(0.5))


def test_aggregations_match_reference() -> None:
    gen = torch.Generator().manual_seed(4)
    values = torch.randn(4, 6, generator=gen)
    mask = torch.tensor([[1] * 6, [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [0] * 6])
    pairs = [(values[i, j].item(), mask[i, j].item()) for i in range(4) for j in range(6)]
    n = sum(m for _, m in pairs)
    assert losses.token_mean(values, mask).item() == pytest.approx(sum(v * m for v, m in pairs) / n, abs=1e-6)
    seq_means = []
    for i in range(4):
        k = int(mask[i].sum())
        seq_means.append(sum(values[i, j].item() for j in range(6) if mask[i, j]) / max(k, 1))
    assert losses.sequence_mean(values, mask).item() == pytest.approx(sum(seq_means) / 4, abs=1e-6)
    assert losses.token_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_sample_advantages_match_the_group_estimator_and_skip_invalid() -> None:
    rewards = [1.0, None, 0.0, 1.0, 0.0]
    out = losses.sample_advantages(rewards, "grpo")
    expected = losses.group_advantages(torch.tensor([[1.0, 0.0, 1.0, 0.0]]), "grpo")[0].tolist()
    assert out[1] is None
    assert [out[i] for i in (0, 2, 3, 4)] == pytest.approx(expected)
    assert losses.sample_advantages([1.0, 1.0, None], "grpo") == [0.0, 0.0, None]  # no signal: all zero
    assert losses.sample_advantages([None, 0.5], "rloo") == [None, 0.0]  # one valid reward: no baseline
