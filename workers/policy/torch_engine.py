"""The torch rollout engine: transformers causal LMs sampled with a hand-written, batched, KV-cached loop.

Used by the demo, the test suite and CPU-only deployments; runs on CPU or one GPU. Prompts are left-padded
into one batch (chunked at ``max_batch_size`` rows), the prompt is prefilled once, then one token per step
is decoded against the cache. Every sampled token's behaviour log-probability is recorded
(``log softmax(logits / temperature)``, see ``workers.policy.engines``). Sampling is seeded: the same engine
seed, calls and batch give the same samples.

Policy versions are applied in place on the resident base model: a LoRA version wraps the base in a peft
adapter (or just loads new adapter tensors when the adapter shape is unchanged); a full-weight version
overwrites the weights after keeping one pristine copy of the base to return to.

Not covered: continuous batching, paged attention, speculative decoding, top-k, repetition penalties,
multiple GPUs. Use the vllm engine for throughput.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from workers.policy import versions
from workers.policy.chat import Prompt, prompt_text
from workers.policy.engines import FinishReason, Sample, SamplingParams, encode_prompts


class TorchEngine:
    """A resident transformers model plus the current policy version."""

    def __init__(
        self,
        base_model_dir: str | Path,
        version_dir: str | Path | None = None,
        device: str = "cpu",
        seed: int = 0,
        max_batch_size: int = 256,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.base_model_dir = Path(base_model_dir)
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.base_model_dir)
        model: Any = AutoModelForCausalLM.from_pretrained(self.base_model_dir, dtype=dtype)
        self.policy = versions.ResidentPolicy(model.to(self.device).eval())
        self.version = 0
        self.seed = seed
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        eos = self.policy.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids = sorted(eos_ids)
        self.pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        )
        if version_dir is not None:
            self.set_version(version_dir)

    @property
    def max_context(self) -> int:
        """Positions the model was built for: prompt and completion together."""
        return int(getattr(self.policy.model.config, "max_position_embeddings", 0) or 0)

    @property
    def model(self) -> Any:
        """The module that generates (the base model, or the base wrapped in the current adapter)."""
        return self.policy.model

    def set_version(self, version_dir: str | Path | None) -> None:
        """Switch to a policy version (None = base) in place; the base weights are never reloaded."""
        self.policy.apply(version_dir)
        self.version = versions.read_version_number(version_dir)

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams) -> list[Sample]:
        return self._generate_rows([(prompt_text(p), ids) for p, ids in
                                    zip(prompts, encode_prompts(self.tokenizer, prompts), strict=True)], sampling)

    def generate_ids(self, contexts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        """Token-in, token-out: continue each context exactly as given (a multi-turn episode's history)."""
        return self._generate_rows([("", list(ids)) for ids in contexts], sampling)

    def _generate_rows(self, prompts: list[tuple[str, list[int]]], sampling: SamplingParams) -> list[Sample]:
        if sampling.n < 1 or sampling.max_tokens < 1:
            raise ValueError("sampling.n and sampling.max_tokens must be at least 1")
        rows = [(p, ids) for p, ids in prompts for _ in range(sampling.n)]
        gen = self._generator
        if sampling.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        out: list[Sample] = []
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            out.extend(self._generate_chunk(chunk, sampling, gen))
        return out

    @torch.no_grad()
    def _generate_chunk(
        self, rows: list[tuple[str, list[int]]], sampling: SamplingParams, gen: torch.Generator
    ) -> list[Sample]:
        model = self.model
        b = len(rows)
        width = max(len(ids) for _, ids in rows)
        input_ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        for i, (_, ids) in enumerate(rows):  # left padding: every row's last prompt token is at -1
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attn[i, width - len(ids) :] = 1
        input_ids, attn = input_ids.to(self.device), attn.to(self.device)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, use_cache=True)
        cache = out.past_key_values
        logits = out.logits[:, -1, :]  # [B, V]
        next_pos = positions[:, -1:] + 1  # [B, 1]
        eos = torch.tensor(self.eos_ids, device=self.device)

        tokens: list[list[int]] = [[] for _ in range(b)]
        logps: list[list[float]] = [[] for _ in range(b)]
        finish: list[FinishReason] = ["length"] * b
        texts: list[str | None] = [None] * b
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        for step in range(sampling.max_tokens):
            token, logp = sample_next(logits, sampling.temperature, sampling.top_p, gen)  # [B], [B]
            token_l, logp_l, done_l = token.tolist(), logp.tolist(), done.tolist()
            hit_eos = torch.isin(token, eos).tolist()
            for i in range(b):
                if done_l[i]:
                    continue
                tokens[i].append(token_l[i])
                logps[i].append(logp_l[i])
                if hit_eos[i]:
                    finish[i] = "stop"
                    done[i] = True
                elif sampling.stop:
                    text = self.tokenizer.decode(tokens[i], skip_special_tokens=True)
                    cut = _first_stop(text, sampling.stop)
                    if cut is not None:
                        texts[i], finish[i] = text[:cut], "stop"
                        done[i] = True
            if bool(done.all()) or step == sampling.max_tokens - 1:
                break
            token = torch.where(done, torch.full_like(token, self.pad_id), token)
            attn = torch.cat([attn, torch.ones((b, 1), dtype=attn.dtype, device=self.device)], dim=1)
            out = model(
                input_ids=token[:, None],
                attention_mask=attn,
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1

        samples = []
        for i, (prompt, ids) in enumerate(rows):
            text = texts[i]
            if text is None:
                text = self.tokenizer.decode(tokens[i], skip_special_tokens=True)
            samples.append(
                Sample(
                    prompt=prompt,
                    prompt_token_ids=list(ids),
                    completion_token_ids=tokens[i],
                    text=text,
                    logprobs=logps[i],
                    finish_reason=finish[i],
                    version=self.version,
                )
            )
        return samples


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and its behaviour log-probability.

    logits: [B, V]; returns (token [B] long, logp [B] float32) where logp is taken under
    softmax(logits / temperature), before top-p truncation (greedy when temperature == 0).
    """
    logits = logits.float()
    if temperature <= 0:
        logp_all = torch.log_softmax(logits, dim=-1)
        token = logits.argmax(dim=-1)
        return token, logp_all.gather(-1, token[:, None]).squeeze(-1)
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp_all.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    token = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return token, logp_all.gather(-1, token[:, None]).squeeze(-1)


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None
