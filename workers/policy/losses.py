"""Advantages and policy-gradient losses as pure tensor functions.

Nothing here touches a model, an optimizer or I/O: every function takes tensors and returns tensors,
and each is checked against a slow, loop-based reference in ``tests/policy/test_losses.py``.

Shape conventions used throughout:
    N  number of groups (prompts) in a batch
    G  samples per group
    B  sequences in a (micro-)batch
    T  completion tokens per sequence (right-padded; ``mask`` marks real tokens)
    V  vocabulary size
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from workers.policy.steps import AdvantageKind


def group_advantages(rewards: Tensor, kind: AdvantageKind = "grpo", eps: float = 1e-6) -> Tensor:
    """Group-relative advantages.

    rewards: [N, G] float, one row per group of samples drawn for the same prompt.
    returns: [N, G]

    - ``grpo``    (r - mean) / (std + eps), std unbiased, as in DeepSeekMath and TRL.
    - ``dr_grpo`` r - mean (no std scaling; Dr. GRPO, Liu et al. 2025).
    - ``rloo``    r_i - mean_{j != i} r_j, the leave-one-out baseline (needs G >= 2).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N, G], got shape {tuple(rewards.shape)}")
    g = rewards.shape[1]
    mean = rewards.mean(dim=1, keepdim=True)
    if kind == "grpo":
        std = rewards.std(dim=1, keepdim=True) if g > 1 else torch.zeros_like(mean)
        return (rewards - mean) / (std + eps)
    if kind == "dr_grpo":
        return rewards - mean
    if kind == "rloo":
        if g < 2:
            raise ValueError("rloo needs at least two samples per group")
        loo_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (g - 1)
        return rewards - loo_mean
    raise ValueError(f"unknown advantage kind {kind!r}; expected grpo, dr_grpo or rloo")


def sample_advantages(rewards: list[float | None], kind: AdvantageKind = "grpo") -> list[float | None]:
    """One group's advantages, where the batch is assembled (prime-rl's orchestrator does the same): the
    valid rewards' group-relative advantages in place, None for an invalid verdict (left out of the loss).
    A group with fewer than two valid rewards, or identical ones, has no learning signal: all zero."""
    valid = [r for r in rewards if r is not None and math.isfinite(r)]
    if len(valid) < 2 or all(r == valid[0] for r in valid):
        return [None if r is None or not math.isfinite(r) else 0.0 for r in rewards]
    adv = iter(group_advantages(torch.tensor([valid], dtype=torch.float32), kind)[0].tolist())
    return [None if r is None or not math.isfinite(r) else next(adv) for r in rewards]


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of each chosen token under softmax(logits / temperature).

    logits: [B, T, V] (position t predicts tokens[:, t])
    tokens: [B, T] long
    returns: [B, T] float32
    """
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) at every position.

    logits: [B, T, V]
    returns: [B, T]
    """
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    logp = torch.log_softmax(scaled, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def kl_k3(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) per token: exp(d) - d - 1 with d = logp_ref - logp.

    Unbiased for samples drawn from pi, always >= 0, low variance.
    logp, logp_ref: [B, T]
    returns: [B, T]
    """
    d = logp_ref - logp
    return torch.exp(d) - d - 1.0


def decoupled_ppo_clip(
    logp: Tensor,
    logp_prox: Tensor,
    logp_behav: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    iw_cap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Decoupled PPO-clip objective (Hilton et al. 2022; AReaL) with asymmetric clip-higher (DAPO).

    The ratio is taken against the proximal policy (the policy before this train step) and clipped to
    [1 - clip_low, 1 + clip_high] around it; staleness of the behaviour policy that actually sampled the
    tokens is corrected by the importance weight w = pi_prox / pi_behav, treated as a constant (no
    gradient) and optionally capped at ``iw_cap``.

        r    = exp(logp - logp_prox)
        loss = -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)

    logp:       [B, T] current policy, with gradient
    logp_prox:  [B, T] proximal policy (no gradient needed)
    logp_behav: [B, T] behaviour policy, as recorded by the engine
    advantages: [B] per sequence, or [B, T] per token
    returns: (loss [B, T], clipped [B, T] bool — the clipped branch was taken, weight [B, T])
    """
    adv = advantages.unsqueeze(-1).expand_as(logp) if advantages.dim() == 1 else advantages
    weight = torch.exp(logp_prox.detach() - logp_behav.detach())
    if iw_cap is not None:
        weight = weight.clamp(max=iw_cap)
    ratio = torch.exp(logp - logp_prox.detach())
    unclipped = ratio * adv
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped_obj = clipped_ratio * adv
    objective = torch.minimum(unclipped, clipped_obj)
    clipped = clipped_obj < unclipped
    return -weight * objective, clipped, weight


def token_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over every real token of the batch (DAPO's token-level aggregation).

    values, mask: [B, T]; returns a scalar. An all-zero mask gives 0, not NaN.
    """
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)


def sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over sequences of each sequence's token mean (the original GRPO aggregation).

    values, mask: [B, T]; returns a scalar.
    """
    m = mask.to(values.dtype)
    per_seq = (values * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)
    return per_seq.mean()
