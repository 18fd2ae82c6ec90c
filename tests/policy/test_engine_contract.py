"""The engine contract, run against every engine in ENGINES (vllm only where it is installed).

Each test attacks one property: shape of the result, agreement with transformers' greedy decoding,
behaviour log-probs equal to a forward-pass recompute, seeded reproducibility, stop strings and lengths,
and version switching with parity against a fresh load of that version.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.policy.demo_model import demo_tasks
from workers.policy.engines import Engine, Sample, SamplingParams, load_engine

PROMPTS = [r["prompt"] for r in demo_tasks("addition", 6, seed=5, split="heldout")] + ["37*6="]
GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=6)

ENGINE_PARAMS = ["torch", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow])]
# The vllm engine runs float32 on CPU too, but its kernels sum in a different order.
LOGPROB_ATOL = {"torch": 1e-4, "vllm": 1e-3}


def _make(name: str, base: Path, version_dir: Path | None = None) -> Engine:
    if name == "vllm":
        pytest.importorskip("vllm")
    return load_engine(name, base, version_dir=version_dir, seed=0)


def _close(engine: Engine) -> None:
    close = getattr(engine, "close", None)
    if close is not None:
        close()


@pytest.fixture(scope="module", params=ENGINE_PARAMS)
def engine(request: pytest.FixtureRequest, demo_dir: Path) -> Iterator[Engine]:
    eng = _make(request.param, demo_dir)
    eng.engine_name = request.param  # type: ignore[attr-defined]
    yield eng
    _close(eng)


def _name(engine: Engine) -> str:
    return str(engine.engine_name)  # type: ignore[attr-defined]


def _hf_model(demo_dir: Path, version_dir: Path | None = None) -> Any:
    from transformers import AutoModelForCausalLM

    from workers.policy import versions

    if version_dir is None:
        return AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    return versions.load_version(demo_dir, version_dir)


@torch.no_grad()
def _recompute_logprobs(model: Any, sample: Sample) -> list[float]:
    ids = torch.tensor([sample.prompt_token_ids + sample.completion_token_ids])
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    start = len(sample.prompt_token_ids) - 1
    return [float(logp[start + i, tok]) for i, tok in enumerate(sample.completion_token_ids)]


def test_result_shape(engine: Engine) -> None:
    engine.set_version(None)
    out = engine.generate(PROMPTS[:3], SamplingParams(n=4, temperature=1.0, max_tokens=5, seed=1))
    assert len(out) == 12
    assert [s.prompt for s in out] == [p for p in PROMPTS[:3] for _ in range(4)]
    for s in out:
        assert s.prompt_token_ids and 1 <= len(s.completion_token_ids) <= 5
        assert len(s.logprobs) == len(s.completion_token_ids)
        assert all(lp <= 0.0 for lp in s.logprobs)
        assert s.finish_reason in ("stop", "length")
        assert s.version == 0
        if s.finish_reason == "length":
            assert len(s.completion_token_ids) == 5


def test_greedy_equals_transformers_generate(engine: Engine, demo_dir: Path) -> None:
    from transformers import AutoTokenizer

    engine.set_version(None)
    out = engine.generate(PROMPTS, GREEDY)
    model = _hf_model(demo_dir)
    tok = AutoTokenizer.from_pretrained(demo_dir)
    for s in out:
        ids = torch.tensor([s.prompt_token_ids])
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        assert s.completion_token_ids == ref[0, ids.shape[1] :].tolist(), s.prompt
    assert sum(s.finish_reason == "stop" for s in out) >= 1


def test_logprobs_match_forward_recompute(engine: Engine, demo_dir: Path) -> None:
    engine.set_version(None)
    out = engine.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7))
    model = _hf_model(demo_dir)
    atol = LOGPROB_ATOL[_name(engine)]
    for s in out:
        assert s.logprobs == pytest.approx(_recompute_logprobs(model, s), abs=atol)


def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    engine.set_version(None)
    spec = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=11)
    other = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=12)
    a = [s.completion_token_ids for s in engine.generate(PROMPTS, spec)]
    b = [s.completion_token_ids for s in engine.generate(PROMPTS, spec)]
    c = [s.completion_token_ids for s in engine.generate(PROMPTS, other)]
    assert a == b
    assert a != c


def test_stop_strings_and_max_tokens(engine: Engine) -> None:
    engine.set_version(None)
    greedy = engine.generate(PROMPTS, GREEDY)
    target = next(s for s in greedy if len(s.text) >= 2)
    stop = target.text[1]
    cut = engine.generate([target.prompt], SamplingParams(temperature=0.0, max_tokens=6, stop=(stop,)))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == target.text[: target.text.index(stop)]
    assert cut.completion_token_ids == target.completion_token_ids[: len(cut.completion_token_ids)]
    one = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1))
    for s, full in zip(one, greedy, strict=True):
        assert s.completion_token_ids == full.completion_token_ids[:1]
        stopped_at_once = full.finish_reason == "stop" and len(full.completion_token_ids) == 1
        assert s.finish_reason == ("stop" if stopped_at_once else "length")


def test_version_switch_matches_fresh_load(
    engine: Engine, demo_dir: Path, lora_versions: tuple[Path, Path]
) -> None:
    v1, v2 = lora_versions
    name = _name(engine)
    engine.set_version(None)
    base = engine.generate(PROMPTS, GREEDY)
    engine.set_version(v1)
    out1 = engine.generate(PROMPTS, GREEDY)
    assert all(s.version == 1 for s in out1)
    assert [s.completion_token_ids for s in out1] != [s.completion_token_ids for s in base]
    engine.set_version(v2)
    switched = engine.generate(PROMPTS, GREEDY)
    assert all(s.version == 2 for s in switched)
    fresh_engine = _make(name, demo_dir, version_dir=v2)
    try:
        fresh = fresh_engine.generate(PROMPTS, GREEDY)
    finally:
        _close(fresh_engine)
    assert [s.completion_token_ids for s in switched] == [s.completion_token_ids for s in fresh]
    for a, b in zip(switched, fresh, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # The adapter is what the engine samples from: log-probs equal a recompute under that version.
    model = _hf_model(demo_dir, v2)
    for s in switched:
        assert s.logprobs == pytest.approx(_recompute_logprobs(model, s), abs=LOGPROB_ATOL[name])
    engine.set_version(None)
    back = engine.generate(PROMPTS, GREEDY)
    assert [s.completion_token_ids for s in back] == [s.completion_token_ids for s in base]
    assert all(s.version == 0 for s in back)


def test_full_weight_versions(engine: Engine, full_version: Path, demo_dir: Path) -> None:
    """torch applies full-weight versions in place; vllm serves LoRA versions only and says so."""
    if _name(engine) == "vllm":
        with pytest.raises(ValueError, match="LoRA versions only"):
            engine.set_version(full_version)
        return
    engine.set_version(full_version)
    out = engine.generate(PROMPTS, GREEDY)
    assert all(s.version == 3 for s in out)
    model = _hf_model(demo_dir, full_version)
    for s in out:
        assert s.logprobs == pytest.approx(_recompute_logprobs(model, s), abs=LOGPROB_ATOL["torch"])
    engine.set_version(None)
