"""The rollout-engine contract: what every engine takes and returns, and the table that picks one by name.

An engine holds a base model in memory plus the current policy version, samples completions, and
records for every completion token the log-probability of the behaviour policy that produced it and
that policy's version. Engines are imported lazily from ``ENGINES`` so that asking for ``torch`` never
imports vllm and the web process imports neither.

Log-probability convention shared by all engines: ``log softmax(logits / temperature)`` of the token
actually sampled (the temperature-scaled distribution, *not* renormalised after top-p truncation; for
greedy decoding, ``temperature == 0``, the plain ``log softmax(logits)``). The trainer recomputes the
same quantity, so behaviour and current log-probs are comparable.

Not covered here: batching across callers, request queues, streaming, multi-GPU placement.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from workers.policy.chat import ChatFormat, Prompt

FinishReason = Literal["stop", "length"]

ENGINES: dict[str, str] = {
    "torch": "workers.policy.torch_engine.TorchEngine",
    "vllm": "workers.policy.vllm_engine.VLLMEngine",
}


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Mirrors the subset of vLLM's SamplingParams that Temper uses."""

    n: int = 1
    """Samples per prompt (a GRPO group); outputs are ordered prompt-major."""
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables it."""
    max_tokens: int = 16
    """Most completion tokens per sample; hitting it gives finish_reason "length"."""
    stop: tuple[str, ...] = ()
    """Stop strings: the text is cut before the first one and finish_reason is "stop"."""
    seed: int | None = None
    """Seed for this call; None continues the engine's own seeded random stream."""


@dataclass
class Sample:
    """One completion and the facts the trainer needs about it."""

    prompt: str
    """The prompt's text (a conversation's contents joined: ``chat.prompt_text``)."""
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    """Includes the end-of-sequence token when generation stopped on it (it is trained on)."""
    text: str
    """Decoded completion without special tokens, cut before a stop string."""
    logprobs: list[float]
    """Behaviour-policy log-probability of each completion token; same length as completion_token_ids."""
    finish_reason: FinishReason
    version: int
    """Policy version that produced every token of this sample (0 = the base model)."""
    extra: dict[str, Any] = field(default_factory=dict)
    mask: list[int] | None = None
    """Loss mask over completion_token_ids: 1 where the policy sampled the token, 0 where it did not (an
    environment's observation in a multi-turn episode). None: every completion token was sampled."""


@runtime_checkable
class Engine(Protocol):
    """What the rollout worker needs from an engine."""

    version: int
    tokenizer: Any
    """The base model's Hugging Face tokenizer (its chat template, when it has one, renders prompts)."""

    @property
    def max_context(self) -> int:
        """Tokens of prompt and completion together the model takes (0: unknown)."""
        ...

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams) -> list[Sample]:
        """``len(prompts) * sampling.n`` samples, prompt-major. A prompt is a text or a conversation
        (``workers.policy.chat``); each sample's ``prompt`` is its text."""
        ...

    def generate_ids(self, contexts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        """The same from token-id contexts, continued exactly as given (token-in, token-out)."""
        ...

    def set_version(self, version_dir: str | Path | None) -> None:
        """Switch to a policy version (None = the base model) without reloading the base weights."""
        ...


def load_engine(
    name: str,
    base_model_dir: str | Path,
    version_dir: str | Path | None = None,
    device: str = "cpu",
    seed: int = 0,
    **options: Any,
) -> Engine:
    """Instantiate the engine registered under ``name`` in ``ENGINES``, importing its module only now."""
    try:
        dotted = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(sorted(ENGINES))}") from None
    module_name, _, cls_name = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"engine {name!r} needs {exc.name or 'a missing package'}; install its requirements "
            f"(the vllm engine runs from requirements-gpu.txt or the .venv-vllm CPU set)"
        ) from exc
    cls = getattr(module, cls_name)
    engine: Engine = cls(base_model_dir, version_dir=version_dir, device=device, seed=seed, **options)
    return engine


def encode_prompts(tokenizer: Any, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Prompt token ids: a conversation through the chat template when the tokenizer has one
    (``workers.policy.chat``), else its text with the tokenizer's special tokens.

    Both engines tokenize here so they condition on identical ids.
    """
    chat = ChatFormat(tokenizer)
    return [chat.prompt_ids(p) for p in prompts]


def read_version_number(version_dir: str | Path | None) -> int:
    """The ``version`` field of a version directory's metadata.json (0 for the base model)."""
    if version_dir is None:
        return 0
    meta = json.loads((Path(version_dir) / "metadata.json").read_text())
    return int(meta["version"])
