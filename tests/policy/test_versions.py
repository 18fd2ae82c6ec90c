"""Policy versions: exact save/load round trips, metadata, merged export, and the torch engine's in-place switch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.policy.conftest import make_full_version
from workers.policy import versions
from workers.policy.engines import SamplingParams
from workers.policy.torch_engine import TorchEngine


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_lora_round_trip_is_exact(demo_dir: Path, lora_versions: tuple[Path, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    v1, _ = lora_versions
    loaded = versions.load_version(demo_dir, v1)
    again = tmp_path / "again"
    versions.save_version(loaded, again, base_model_dir=demo_dir, version=1, parent=0, step=1)
    a = load_file(str(v1 / "adapter_model.safetensors"))
    b = load_file(str(again / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lora_params = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert len(lora_params) == len(a)
    # Every saved tensor is what the loaded model holds, bit for bit.
    for key, tensor in a.items():
        match = [v for k, v in lora_params.items() if k.replace(".default", "") == key]
        assert len(match) == 1 and torch.equal(match[0], tensor), key


def test_full_round_trip_is_exact(demo_dir: Path, full_version: Path) -> None:
    from transformers import AutoModelForCausalLM

    loaded = versions.load_version(demo_dir, full_version)
    fresh = AutoModelForCausalLM.from_pretrained(full_version, dtype=torch.float32)
    s1, s2 = _state(loaded), _state(fresh)
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    base = _state(AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32))
    assert not torch.equal(base["model.embed_tokens.weight"], s1["model.embed_tokens.weight"])


def test_metadata(lora_versions: tuple[Path, Path], full_version: Path, demo_dir: Path) -> None:
    meta = versions.read_metadata(lora_versions[1])
    assert (meta.kind, meta.version, meta.parent, meta.step) == ("lora", 2, 1, 2)
    assert meta.base_model == str(demo_dir)
    assert meta.files and set(meta.files) == {"adapter_model.safetensors"}
    assert versions.read_metadata(full_version).kind == "full"
    assert versions.read_version_number(None) == 0
    adapter_cfg = json.loads((lora_versions[0] / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 16 and adapter_cfg["base_model_name_or_path"] == str(demo_dir)


def test_read_metadata_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a policy version"):
        versions.read_metadata(tmp_path)
    (tmp_path / "metadata.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="unknown format"):
        versions.read_metadata(tmp_path)


@pytest.mark.parametrize("which", ["lora", "full"])
def test_export_merged_loads_with_automodel(
    which: str, demo_dir: Path, lora_versions: tuple[Path, Path], full_version: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    vdir = lora_versions[0] if which == "lora" else full_version
    out = versions.export_merged(vdir, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok.encode("37+48=")])
    with torch.no_grad():
        want = versions.load_version(demo_dir, vdir)(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_theta"] == 10000.0 and "lora" not in json.dumps(cfg).lower()
    assert (
        json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"]
        == "PreTrainedTokenizerFast"
    )


def test_torch_engine_switches_full_and_lora_versions_in_place(
    demo_dir: Path, lora_versions: tuple[Path, Path], full_version: Path, tmp_path: Path
) -> None:
    prompts = ["12+34=", "55+45=", "37*6="]
    greedy = SamplingParams(temperature=0.0, max_tokens=5)

    def run(engine: TorchEngine) -> list[tuple[list[int], list[float]]]:
        return [(s.completion_token_ids, s.logprobs) for s in engine.generate(prompts, greedy)]

    fresh: dict[Path | None, list[tuple[list[int], list[float]]]] = {}

    def fresh_run(vdir: Path | None) -> list[tuple[list[int], list[float]]]:
        if vdir not in fresh:
            fresh[vdir] = run(TorchEngine(demo_dir, version_dir=vdir))
        return fresh[vdir]

    engine = TorchEngine(demo_dir)
    base = run(engine)
    for vdir in (full_version, lora_versions[0], full_version, None, lora_versions[1]):
        engine.set_version(vdir)
        assert run(engine) == fresh_run(vdir)
    engine.set_version(None)
    assert run(engine) == base
    other = make_full_version(demo_dir, tmp_path / "v9", version=9, seed=9)
    engine.set_version(other)
    assert engine.version == 9
    assert run(engine) == fresh_run(other)


def test_demo_model_files(demo_dir: Path) -> None:
    cfg = json.loads((demo_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["rope_theta"] == 10000.0
    assert cfg["head_dim"] == 64 and cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == 258
    tok_cfg = json.loads((demo_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    report = json.loads((demo_dir / "build_report.json").read_text())
    assert 0.30 <= report["heldout_exact_match"]["addition"] <= 0.50
    assert 1_000_000 < report["parameters"] < 1_200_000
