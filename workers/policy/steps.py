"""What one train step takes and gives, as plain data: the trainer's configuration, a group of samples with
their rewards, the step's metrics and its result. No torch here: the GPU worker assembles a batch and reads a
step's result without importing it, while its device process trains (``workers.policy.device_process``).
``workers.policy.trainer`` does the training and re-exports these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from workers.policy.engines import Sample

AdvantageKind = Literal["grpo", "dr_grpo", "rloo"]
LossAggregation = Literal["token_mean", "sequence_mean"]


@dataclass(frozen=True)
class TrainerConfig:
    """Hyper-parameters of the trainer. Defaults are the ones measured to work on the demo model."""

    advantage: AdvantageKind = "grpo"
    """Group baseline: grpo (mean/std), dr_grpo (mean only) or rloo (leave-one-out)."""
    lr: float = 5e-4
    """AdamW learning rate. Measured on the demo model: LoRA r=16 gains +45 points in ~250 steps at 5e-4
    (1e-3 is noisy); full fine-tune wants 1e-4 (>= 3e-4 collapses)."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm."""
    clip_low: float = 0.2
    """PPO ratio lower clip: ratio >= 1 - clip_low."""
    clip_high: float = 0.2
    """PPO ratio upper clip (clip-higher when > clip_low): ratio <= 1 + clip_high."""
    iw_cap: float | None = 5.0
    """Cap on the importance weight pi_prox / pi_behav; None for no cap."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the base model (0 disables the reference forward pass)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    temperature: float = 1.0
    """Sampling temperature the engine used; log-probs are recomputed under the same scaling."""
    num_minibatches: int = 2
    """Optimizer updates per train step (the samples are shuffled and split this many ways)."""
    micro_batch_size: int = 64
    """Sequences per forward/backward pass; gradients accumulate across micro-batches."""
    lora_rank: int = 16
    """LoRA rank; 0 means full fine-tuning."""
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    loss_aggregation: LossAggregation = "token_mean"
    """How per-token losses become one number: ``token_mean`` over every token of a minibatch (DAPO's) or
    ``sequence_mean``, the mean of each sequence's token mean (the original GRPO's), as TRL's ``loss_type``."""
    collapse_patience: int = 10
    """Consecutive steps in which every group has identical rewards before collapse is reported."""
    seed: int = 0
    device: str = "cpu"
    """A torch device (``workers.policy.device`` resolves ``TEMPER_DEVICE`` to one)."""
    autocast: str = "float32"
    """``bfloat16``: forward passes under bfloat16 autocast on CUDA (weights and optimizer stay float32)."""


@dataclass
class Group:
    """The samples drawn for one prompt and their verdicts (None = invalid: excluded, never scored 0).

    ``advantages`` are computed where the batch is assembled (``losses.sample_advantages``); the trainer
    then stays blind to the estimator. Without them it computes them itself with ``config.advantage`` (the
    bare demo loop does)."""

    samples: Sequence[Sample]
    rewards: Sequence[float | None]
    advantages: Sequence[float | None] | None = None


@dataclass
class TrainMetrics:
    step: int
    loss: float = 0.0
    clip_fraction: float = 0.0
    kl: float = 0.0
    """Mean k3 KL of the updated-from policy to the behaviour policy (staleness drift), per token."""
    kl_ref: float = 0.0
    """Mean k3 KL to the base model, only when kl_coef > 0."""
    entropy: float = 0.0
    grad_norm: float = 0.0
    iw_mean: float = 1.0
    iw_max: float = 1.0
    iw_min: float = 1.0
    tokens_trained: int = 0
    samples_trained: int = 0
    groups_used: int = 0
    groups_dropped_zero_variance: int = 0
    samples_dropped_invalid: int = 0
    clipped_samples: list[tuple[int, int]] = field(default_factory=list)
    """(group index, sample index) of every trained sample with at least one clipped token."""
    reward_mean: float = 0.0
    advantage_abs_mean: float = 0.0
    updated: bool = False
    collapsed: bool = False
    collapse_reason: str | None = None
    zero_variance_streak: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StepResult:
    """A trained and saved step: the trainer's metrics, the version it saved, and each sample's advantage
    as the batch was assembled (per group, in sample order; None for an invalid verdict)."""

    metrics: TrainMetrics
    version: int
    advantages: list[list[float | None]]
