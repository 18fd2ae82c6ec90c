"""The run specification: one frozen pydantic model, validated once when a run is created.

Every field documents itself; the API, the admin and the new-run page show these descriptions.
Pure: imports neither Django nor torch, so the scheduler and the web process share it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class SamplingSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(1.0, ge=0.0, le=5.0, description="Sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass")
    max_tokens: int = Field(16, ge=1, le=32768, description="Most tokens generated per completion")
    stop: tuple[str, ...] = Field((), description="Strings that end a completion")


class AlgorithmSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    advantage: Literal["grpo", "dr_grpo", "rloo"] = Field(
        "grpo", description="Group-relative advantage: GRPO (mean/std), Dr.GRPO (mean only), RLOO (leave-one-out)"
    )
    learning_rate: float = Field(
        5e-4, gt=0.0, le=1.0,
        description="AdamW learning rate (LoRA: 5e-4 measured best on the demo; full fine-tuning wants ~1e-4)",
    )
    lora_rank: int = Field(16, ge=0, le=1024, description="LoRA rank; 0 means full fine-tuning")
    lora_alpha: int = Field(32, ge=1, description="LoRA scaling numerator")
    clip_low: float = Field(0.2, ge=0.0, le=1.0, description="PPO clip below 1 (ratio >= 1 - clip_low)")
    clip_high: float = Field(0.28, ge=0.0, le=10.0, description="PPO clip above 1 (clip-higher when > clip_low)")
    kl_coef: float = Field(0.0, ge=0.0, description="k3 KL penalty to the base model (0 disables)")
    loss_aggregation: Literal["token_mean", "sequence_mean"] = Field(
        "token_mean", description="token_mean: every token of a minibatch weighs the same (DAPO); sequence_mean: "
        "the mean of each sequence's token mean (the original GRPO)")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm")
    updates_per_batch: int = Field(2, ge=1, le=16, description="Optimizer minibatch updates per train batch")
    micro_batch_size: int = Field(32, ge=1, description="Sequences per forward/backward pass (memory bound)")


class PipelineSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["async", "sync"] = Field(
        "async", description="async: generate, verify and train overlap; sync: one stage at a time"
    )
    group_size: int = Field(8, ge=2, le=256, description="Completions sampled per prompt (G)")
    batch_prompts: int = Field(16, ge=1, le=4096, description="Complete prompt groups per train step (B)")
    max_staleness: int = Field(
        1, ge=0, le=64, description="How many versions behind the newest a trained sample may be (0 = on-policy)"
    )
    rollout_batch_prompts: int = Field(16, ge=1, le=4096, description="Prompts per generation task")
    invalid_retries: int = Field(
        2, ge=0, le=10,
        description="Times a prompt whose group got an invalid verdict is admitted again, ahead of new prompts",
    )
    eval_chunk: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Held-out sequences (tasks x k) per evaluation chunk, each its own message queued behind the "
        "waiting generation and training (default: one batch up to 1,024 sequences; beyond that, one generation "
        "task's worth, at least 64)",
    )


class EpisodeSpec(BaseModel):
    """Limits of a multi-turn episode (domains whose environment is not single_turn). They end episodes,
    never the run; each episode records why it stopped."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_turns: int = Field(4, ge=1, le=256, description="Model turns per episode")
    max_tokens_per_turn: int | None = Field(
        None, ge=1, le=32768, description="Tokens per model turn (default: sampling.max_tokens)")
    context_tokens: int | None = Field(
        None, ge=16, description="The model's context for a whole episode (default: the base model's)")
    deadline_seconds: float = Field(60.0, gt=0, le=3600, description="Wall time of one episode")
    tool_seconds: float = Field(2.0, gt=0, le=600, description="Wall time of one tool call (then a timeout "
                                                                "observation, and the episode goes on)")


class RunSpec(BaseModel):
    """Everything that decides what a run does; stored on the run as JSON."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)  # type: ignore[arg-type]
    pipeline: PipelineSpec = Field(default_factory=PipelineSpec)  # type: ignore[arg-type]
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)  # type: ignore[arg-type]
    episode: EpisodeSpec = Field(default_factory=EpisodeSpec)  # type: ignore[arg-type]
    max_steps: int = Field(200, ge=1, le=10_000_000, description="Train steps before the run completes")
    target_reward: float | None = Field(
        None, ge=0.0, le=1.0, description="Complete early once held-out reward reaches this"
    )
    eval_every: int = Field(10, ge=0, description="Evaluate held-out tasks every N versions (0 = never)")
    eval_tasks: int = Field(64, ge=1, le=100_000, description="Held-out tasks per domain per evaluation")
    seed: int = Field(0, ge=0, description="Seed for sampling and data order")
    share: float = Field(
        1.0, gt=0.0, le=1000.0,
        description="This run's share of shared GPU workers: runs with work waiting get device time in the "
        "ratio of their shares (a run ahead of its share admits nothing new until it is not)",
    )
    collapse_window: int = Field(
        20, ge=1, description="Steps of identical rewards in every group after which training has collapsed"
    )
    auto_pause_on_collapse: bool = Field(False, description="Pause the run when a collapse is detected")
    invalid_rate_alert: float = Field(
        0.2, ge=0.0, le=1.0, description="Alert when more than this share of the latest verdicts is invalid"
    )
    staleness_alert: int | None = Field(
        None, ge=0,
        description="Alert when trained samples lag more versions than this (default: pipeline.max_staleness), "
        "or when more than a batch of groups was dropped as too stale",
    )
    stall_alert_seconds: float = Field(
        180.0, gt=0, description="Alert when a stage holds work this long without progress"
    )
    max_task_failures: int = Field(
        3, ge=1, le=100,
        description="Fail the run when one of its tasks raises the same error this many times (between train "
        "steps): a failure that repeats is not transient, and retrying it forever hides it",
    )

    @model_validator(mode="after")
    def _check(self) -> RunSpec:
        if self.algorithm.clip_high < self.algorithm.clip_low:
            raise ValueError("algorithm.clip_high must be ≥ algorithm.clip_low (clip-higher is asymmetric upward)")
        return self


def validation_messages(error: ValidationError) -> dict[str, list[str]]:
    """Pydantic errors as ``{"dotted.field": ["reason", ...]}`` for people and for the API."""
    out: dict[str, list[str]] = {}
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "spec"
        out.setdefault(field, []).append(item["msg"])
    return out
