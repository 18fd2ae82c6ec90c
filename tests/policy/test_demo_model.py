"""The demo domains, the exact-match scorer, and the demo base-model build."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.policy.conftest import DEMO_DIR, REPO
from workers.policy.demo_model import DOMAINS, demo_tasks, exact_match, extract_answer


@pytest.mark.parametrize("domain", DOMAINS)
def test_tasks_are_deterministic_correct_and_split(domain: str) -> None:
    rows = demo_tasks(domain, 50, seed=3, split="train")
    assert rows == demo_tasks(domain, 50, seed=3, split="train")
    assert rows != demo_tasks(domain, 50, seed=4, split="train")
    for row in rows:
        a, op, b = row["prompt"].rstrip("=").partition("+" if "+" in row["prompt"] else "*")
        assert row["answer"] == str(int(a) + int(b) if op == "+" else int(a) * int(b))
    train = {r["prompt"] for r in demo_tasks(domain, 10_000, seed=0, split="train")}
    heldout = {r["prompt"] for r in demo_tasks(domain, 10_000, seed=0, split="heldout")}
    assert train and heldout and not train & heldout


def test_unknown_domain_and_split() -> None:
    with pytest.raises(ValueError, match="unknown demo domain"):
        demo_tasks("poetry", 1)
    with pytest.raises(ValueError, match="unknown split"):
        demo_tasks("addition", 1, split="test")  # type: ignore[arg-type]


def test_exact_match() -> None:
    assert exact_match("85", "85") == 1.0
    assert exact_match(" 85 \nmore", "85") == 1.0
    assert exact_match("85<|endoftext|>", "85") == 1.0
    assert exact_match("851", "85") == 0.0
    assert exact_match("", "85") == 0.0
    assert extract_answer("12\n34") == "12"


def test_tokenizer_is_byte_level_and_round_trips(demo_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir)
    assert len(tok) == 258 and tok.eos_token_id == 256 and tok.pad_token_id == 257
    text = "37+48=85 ünïcode\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode()) and tok.decode(ids) == text
    assert tok.encode("0", add_special_tokens=False) == [ord("0")]


@pytest.mark.slow
def test_build_is_mediocre_like_the_committed_model(tmp_path: Path) -> None:
    """The CLI rebuilds the model, landing at 30-50 % held-out like the committed one (~70 s here; the
    subprocess timeout is only a safety net, not a bound the test measures).

    Not bit for bit against the committed file: float kernels differ between CPUs (on an AMD EPYC the
    rebuild chose step 520 at 35 %, the committed build step 540 at 33.7 %). Determinism on one machine
    is the next test's job.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "workers.policy.demo_model", str(tmp_path / "demo")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "held-out exact match addition" in proc.stderr
    report = json.loads((tmp_path / "demo" / "build_report.json").read_text())
    committed = json.loads((DEMO_DIR / "build_report.json").read_text())
    assert 0.30 <= report["heldout_exact_match"]["addition"] <= 0.50
    assert report["heldout_exact_match"]["multiplication"] < report["heldout_exact_match"]["addition"]
    assert report["parameters"] == committed["parameters"]


@pytest.mark.slow
def test_build_is_deterministic_on_one_machine(tmp_path: Path) -> None:
    """Two short builds with the same seed write the same bytes."""
    import torch

    from workers.policy.demo_model import build_demo_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in ("a", "b"):
            build_demo_model(tmp_path / name, seed=3, max_steps=100, eval_every=100, target=(0.0, 1.0))
    finally:
        torch.set_num_threads(threads)
    first = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert first == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_demo_long_is_the_demo_model_declared_with_a_longer_context(demo_dir: Path) -> None:
    """``demo-long`` (for domains with longer prompts, such as a reasoning-gym pack) links the demo model's
    weights and tokenizer and differs only in the context it declares, which the engine reports and samples
    within: a 600-token prompt, ten times the demo's 64 positions."""
    from workers.policy.engines import SamplingParams, load_engine

    long_dir = demo_dir.parent / "demo-long"
    for name in ("model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (long_dir / name).resolve() == (demo_dir / name).resolve(), name
    config, long_config = (json.loads((d / "config.json").read_text()) for d in (demo_dir, long_dir))
    assert {k for k in config if config[k] != long_config.get(k)} == {"max_position_embeddings"}
    engine = load_engine("torch", long_dir)
    assert engine.max_context == long_config["max_position_embeddings"] == 1024
    prompt = engine.tokenizer.encode("What is 12+34? " * 40, add_special_tokens=False)
    assert len(prompt) == 600
    samples = engine.generate_ids([prompt], SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=0))
    assert len(samples) == 2
    for s in samples:
        assert 1 <= len(s.completion_token_ids) <= 6 and len(s.logprobs) == len(s.completion_token_ids)
        assert all(lp <= 0.0 for lp in s.logprobs)
