"""The policy trainer: one GRPO-family step from scored groups of samples, and versions saved from it.

``Trainer.train_step(groups)``:
  1. drops samples whose verdict is invalid (reward None) and groups left with fewer than two samples or
     with identical rewards (zero variance: no learning signal);
  2. computes group-relative advantages (grpo, dr_grpo or rloo; ``workers.policy.losses``);
  3. recomputes the proximal log-probs (the policy before this step) once, without gradient;
  4. splits the samples into ``num_minibatches`` optimizer updates, each accumulated over micro-batches
     of ``micro_batch_size`` sequences, with the decoupled PPO-clip loss (importance weight
     pi_prox / pi_behav for stale samples), token-mean aggregation, optional k3 KL to the base model and
     entropy bonus, gradient clipping and AdamW;
  5. reports metrics, including collapse: every group's rewards identical for ``collapse_patience``
     consecutive steps, or a non-finite loss (the optimizer step is then skipped).

LoRA through peft by default (only adapter parameters train); full fine-tuning with ``lora_rank=0``.
Not covered: distributed data parallel, sequence packing, mixed precision, gradient checkpointing.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from workers.policy import losses, versions
from workers.policy.steps import Group, TrainerConfig, TrainMetrics

__all__ = ["Group", "TrainMetrics", "Trainer", "TrainerConfig"]


@dataclass
class _Row:
    key: tuple[int, int]
    """(group index, sample index) in the batch."""
    prompt_ids: list[int]
    completion_ids: list[int]
    behav: list[float]
    advantage: float
    mask: list[int] | None = None
    """1 on tokens the policy sampled; None: all of them (see ``Sample.mask``)."""

    @property
    def trained_tokens(self) -> int:
        return len(self.completion_ids) if self.mask is None else sum(self.mask)


class Trainer:
    """Owns the trainable policy, its optimizer and the step counter."""

    def __init__(
        self,
        base_model_dir: str | Path,
        config: TrainerConfig | None = None,
        version_dir: str | Path | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config or TrainerConfig()
        self.base_model_dir = Path(base_model_dir)
        torch.manual_seed(self.config.seed)
        self._rng = random.Random(self.config.seed)
        self.device = torch.device(self.config.device)
        self.version = 0
        self.parent: int | None = None
        self.step = 0
        self.zero_variance_streak = 0
        if version_dir is not None:
            meta = versions.read_metadata(version_dir)
            self.model = versions.load_version(
                self.base_model_dir, version_dir, self.config.device, trainable=True
            )
            self.version, self.step = meta.version, meta.step
        else:
            model: Any = AutoModelForCausalLM.from_pretrained(self.base_model_dir, dtype=torch.float32)
            if self.config.lora_rank > 0:
                from peft import LoraConfig, get_peft_model

                lora = LoraConfig(
                    r=self.config.lora_rank,
                    lora_alpha=self.config.lora_alpha,
                    lora_dropout=self.config.lora_dropout,
                    target_modules=list(self.config.lora_target_modules),
                    bias="none",
                    task_type="CAUSAL_LM",
                )
                model = get_peft_model(model, lora)
            self.model = model.to(self.device)
        self.model.train()
        self._ref_model: Any = None
        self.optimizer = torch.optim.AdamW(
            self.trainable_parameters(),
            lr=self.config.lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
        )
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)

    @property
    def is_lora(self) -> bool:
        return versions._is_peft(self.model)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ batches

    def _rows_from_groups(self, groups: Sequence[Group], metrics: TrainMetrics) -> list[_Row]:
        rows: list[_Row] = []
        kept_rewards: list[float] = []
        for gi, group in enumerate(groups):
            advantages = (list(group.advantages) if group.advantages is not None
                          else losses.sample_advantages(list(group.rewards), self.config.advantage))
            valid = [(si, s, r, a) for si, (s, r, a) in enumerate(zip(group.samples, group.rewards, advantages,
                                                                      strict=True))
                     if r is not None and math.isfinite(r) and a is not None]
            metrics.samples_dropped_invalid += len(group.samples) - len(valid)
            if len(valid) < 2 or all(a == 0.0 for *_, a in valid):
                metrics.groups_dropped_zero_variance += 1
                continue
            metrics.groups_used += 1
            kept_rewards.extend(r for _, _, r, _ in valid)
            for si, sample, _, a in valid:
                if not sample.completion_token_ids:
                    continue
                if sample.mask is not None and not any(sample.mask):
                    continue  # nothing of it was sampled by the policy
                rows.append(_Row((gi, si), sample.prompt_token_ids, sample.completion_token_ids, sample.logprobs, a,
                                 sample.mask))
        if kept_rewards:
            metrics.reward_mean = sum(kept_rewards) / len(kept_rewards)
            metrics.advantage_abs_mean = sum(abs(r.advantage) for r in rows) / max(len(rows), 1)
        return rows

    def _collate(self, rows: Sequence[_Row]) -> dict[str, torch.Tensor]:
        """Right-padded prompt+completion ids [B, L]; completion-aligned tensors [B, T] and mask."""
        b = len(rows)
        width = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
        t = max(len(r.completion_ids) for r in rows)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        # index into logits [B, L-1, V] of the position predicting each completion token
        gather = torch.zeros((b, t), dtype=torch.long)
        tokens = torch.zeros((b, t), dtype=torch.long)
        behav = torch.zeros((b, t))
        mask = torch.zeros((b, t))
        for i, r in enumerate(rows):
            seq = r.prompt_ids + r.completion_ids
            ids[i, : len(seq)] = torch.tensor(seq)
            attn[i, : len(seq)] = 1
            n = len(r.completion_ids)
            start = len(r.prompt_ids) - 1
            gather[i, :n] = torch.arange(start, start + n)
            tokens[i, :n] = torch.tensor(r.completion_ids)
            behav[i, :n] = torch.tensor(r.behav[:n])
            # the loss mask: 1 only on tokens the policy sampled, so every statistic of the loss (ratios,
            # importance weights, KL, entropy, clipping) is taken over them and nothing else
            mask[i, :n] = 1 if r.mask is None else torch.tensor(r.mask[:n], dtype=mask.dtype)
        adv = torch.tensor([r.advantage for r in rows])
        out = {
            "ids": ids,
            "attn": attn,
            "gather": gather,
            "tokens": tokens,
            "behav": behav,
            "mask": mask,
            "adv": adv,
        }
        return {k: v.to(self.device) for k, v in out.items()}

    def _completion_logits(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits [B, T, V] (float32) at the positions that predict each completion token."""
        if self.config.autocast == "bfloat16" and self.device.type == "cuda":
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                logits = model(input_ids=batch["ids"], attention_mask=batch["attn"]).logits.float()
        else:
            logits = model(input_ids=batch["ids"], attention_mask=batch["attn"]).logits
        idx = batch["gather"].unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        return logits.gather(1, idx)

    @torch.no_grad()
    def _logprobs(self, rows: Sequence[_Row], reference: bool = False) -> list[torch.Tensor]:
        """Per-row log-probs [T_i] of the current (or base) policy, micro-batched, no gradient."""
        self.model.eval()
        out: list[torch.Tensor] = []
        mb = self.config.micro_batch_size
        for start in range(0, len(rows), mb):
            chunk = rows[start : start + mb]
            batch = self._collate(chunk)
            if reference:
                logits = self._reference_logits(batch)
            else:
                logits = self._completion_logits(self.model, batch)
            lp = losses.token_logprobs(logits, batch["tokens"], self.config.temperature)
            out.extend(lp[i, : len(r.completion_ids)].cpu() for i, r in enumerate(chunk))
        self.model.train()
        return out

    def _reference_logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.is_lora:
            with self.model.disable_adapter():
                return self._completion_logits(self.model, batch)
        if self._ref_model is None:
            from transformers import AutoModelForCausalLM

            ref: Any = AutoModelForCausalLM.from_pretrained(self.base_model_dir, dtype=torch.float32)
            self._ref_model = ref.to(self.device).eval()
        return self._completion_logits(self._ref_model, batch)

    # ------------------------------------------------------------------ the step

    def train_step(self, groups: Sequence[Group]) -> TrainMetrics:
        import time

        started = time.monotonic()
        cfg = self.config
        metrics = TrainMetrics(step=self.step + 1)
        rows = self._rows_from_groups(groups, metrics)
        self.step += 1
        if not rows:
            self.zero_variance_streak += 1
            return self._finish(metrics, started)
        self.zero_variance_streak = 0
        prox = self._logprobs(rows)
        ref = self._logprobs(rows, reference=True) if cfg.kl_coef > 0 else None
        order = list(range(len(rows)))
        self._rng.shuffle(order)
        n_mb = max(1, min(cfg.num_minibatches, len(rows)))
        minibatches = [order[i::n_mb] for i in range(n_mb)]
        sums = {
            "loss": 0.0,
            "clipped": 0.0,
            "kl": 0.0,
            "kl_ref": 0.0,
            "entropy": 0.0,
            "iw": 0.0,
            "tokens": 0.0,
        }
        iw_max, iw_min, grad_norms = 0.0, float("inf"), []
        for mb_idx in minibatches:
            mb_tokens = sum(rows[i].trained_tokens for i in mb_idx)
            self.optimizer.zero_grad(set_to_none=True)
            nonfinite = False
            for start in range(0, len(mb_idx), cfg.micro_batch_size):
                idx = mb_idx[start : start + cfg.micro_batch_size]
                chunk = [rows[i] for i in idx]
                batch = self._collate(chunk)
                t = batch["mask"].shape[1]
                prox_t = _pad_stack([prox[i] for i in idx], t).to(self.device)
                logits = self._completion_logits(self.model, batch)
                logp = losses.token_logprobs(logits, batch["tokens"], cfg.temperature)
                mask = batch["mask"]
                # Tokens the policy did not sample have no behaviour log-prob: give them the proximal one, so
                # that nothing computed for them (a ratio, a weight, a KL) can overflow before the mask drops it.
                behav = torch.where(mask.bool(), batch["behav"], prox_t)
                per_token, clipped, weight = losses.decoupled_ppo_clip(
                    logp, prox_t, behav, batch["adv"], cfg.clip_low, cfg.clip_high, cfg.iw_cap
                )
                entropy = losses.entropy_from_logits(logits, cfg.temperature)
                if cfg.entropy_coef:
                    per_token = per_token - cfg.entropy_coef * entropy
                if ref is not None:
                    ref_t = _pad_stack([ref[i] for i in idx], t).to(self.device)
                    kl_ref = losses.kl_k3(logp, ref_t)
                    per_token = per_token + cfg.kl_coef * kl_ref
                    sums["kl_ref"] += float((kl_ref.detach() * mask).sum())
                # Aggregated over the whole minibatch: each micro-batch weighted by its share of it.
                if cfg.loss_aggregation == "sequence_mean":
                    loss = losses.sequence_mean(per_token, mask) * (len(chunk) / len(mb_idx))
                else:
                    loss = losses.token_mean(per_token, mask) * (float(mask.sum()) / max(mb_tokens, 1))
                if not torch.isfinite(loss):
                    nonfinite = True
                    break
                loss.backward()
                sums["loss"] += float(loss.detach()) * mb_tokens
                sums["clipped"] += float((clipped.float() * mask).sum())
                sums["kl"] += float((losses.kl_k3(prox_t, behav) * mask).sum())
                sums["entropy"] += float((entropy.detach() * mask).sum())
                sums["iw"] += float((weight * mask).sum())
                sums["tokens"] += float(mask.sum())
                row_clipped = (clipped & mask.bool()).any(dim=1).tolist()
                metrics.clipped_samples.extend(r.key for r, c in zip(chunk, row_clipped, strict=True) if c)
                real = weight[mask.bool()]
                iw_max, iw_min = max(iw_max, float(real.max())), min(iw_min, float(real.min()))
            if nonfinite:
                self.optimizer.zero_grad(set_to_none=True)
                metrics.collapsed, metrics.collapse_reason = True, "non-finite loss (optimizer step skipped)"
                break
            grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), cfg.max_grad_norm)
            if not torch.isfinite(grad_norm):
                self.optimizer.zero_grad(set_to_none=True)
                metrics.collapsed, metrics.collapse_reason = (
                    True,
                    "non-finite gradient (optimizer step skipped)",
                )
                break
            self.optimizer.step()
            metrics.updated = True
            grad_norms.append(float(grad_norm))
        tokens = max(sums["tokens"], 1.0)
        metrics.loss = sums["loss"] / tokens
        metrics.clip_fraction = sums["clipped"] / tokens
        metrics.kl = sums["kl"] / tokens
        metrics.kl_ref = sums["kl_ref"] / tokens
        metrics.entropy = sums["entropy"] / tokens
        metrics.iw_mean = sums["iw"] / tokens
        metrics.iw_max = iw_max if sums["tokens"] else 1.0
        metrics.iw_min = iw_min if sums["tokens"] else 1.0
        metrics.grad_norm = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0
        metrics.tokens_trained = int(sums["tokens"])
        metrics.samples_trained = len(rows)
        return self._finish(metrics, started)

    def _finish(self, metrics: TrainMetrics, started: float) -> TrainMetrics:
        import time

        metrics.zero_variance_streak = self.zero_variance_streak
        if not metrics.collapsed and self.zero_variance_streak >= self.config.collapse_patience:
            metrics.collapsed = True
            metrics.collapse_reason = (
                f"every group's rewards were identical for {self.zero_variance_streak} consecutive steps "
                "(no learning signal; the policy may have collapsed to a constant answer)"
            )
        metrics.seconds = time.monotonic() - started
        return metrics

    # ------------------------------------------------------------------ versions

    def save_version(self, out_dir: str | Path, spec_hash: str | None = None) -> versions.VersionMetadata:
        """Save the current policy as version ``self.version + 1`` whose parent is the current version."""
        meta = versions.save_version(
            self.model,
            out_dir,
            base_model_dir=self.base_model_dir,
            version=self.version + 1,
            parent=self.version,
            step=self.step,
            spec_hash=spec_hash,
        )
        self.version = meta.version
        return meta


def _pad_stack(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width))
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out
