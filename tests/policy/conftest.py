"""Fixtures for the policy tests: the committed demo base model and small policy versions built from it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
DEMO_DIR = REPO / "assets" / "base-models" / "demo"


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """One intra-op thread: the models are tiny, and on a shared CPU extra OpenMP threads cost up to ~7x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    if not (DEMO_DIR / "model.safetensors").exists():
        pytest.fail(f"{DEMO_DIR} is missing: build it with `python -m workers.policy.demo_model {DEMO_DIR}`")
    return DEMO_DIR


def make_lora_version(base_dir: Path, out_dir: Path, version: int, seed: int, scale: float = 0.3) -> Path:
    """A LoRA version whose B matrices are random (peft initialises them to zero: a no-op adapter)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from workers.policy import versions

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=16,
        lora_alpha=32,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, scale)
    versions.save_version(
        peft_model, out_dir, base_model_dir=base_dir, version=version, parent=version - 1, step=version
    )
    return out_dir


def make_full_version(base_dir: Path, out_dir: Path, version: int, seed: int, scale: float = 0.05) -> Path:
    """A full-weight version: the base with every parameter perturbed."""
    from transformers import AutoModelForCausalLM

    from workers.policy import versions

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    versions.save_version(
        model, out_dir, base_model_dir=base_dir, version=version, parent=version - 1, step=version
    )
    return out_dir


@pytest.fixture(scope="session")
def lora_versions(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("versions")
    return (
        make_lora_version(demo_dir, root / "v1", version=1, seed=1),
        make_lora_version(demo_dir, root / "v2", version=2, seed=2),
    )


@pytest.fixture(scope="session")
def full_version(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_full_version(demo_dir, tmp_path_factory.mktemp("full") / "v3", version=3, seed=3)
