"""The GPU worker's resident engines and trainers: versions named by (run, number), a memory budget with
least-recently-used eviction, and placement on ``TEMPER_DEVICE`` (real engines on the demo model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.policy.conftest import DEMO_DIR, make_lora_version
from workers.policy import resident
from workers.policy.engines import SamplingParams


@pytest.fixture(autouse=True)
def _empty(monkeypatch: pytest.MonkeyPatch):
    resident._ENGINES.clear()
    resident._TRAINERS.clear()
    monkeypatch.setattr(resident, "_PLACEMENT", None)
    yield
    resident._ENGINES.clear()
    resident._TRAINERS.clear()


def greedy(engine, prompts):
    return [s.completion_token_ids for s in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4))]


def test_an_engine_switches_between_two_runs_versions_of_the_same_number(tmp_path: Path):
    a5 = make_lora_version(DEMO_DIR, tmp_path / "a" / "v5", version=5, seed=1, scale=0.5)
    b5 = make_lora_version(DEMO_DIR, tmp_path / "b" / "v5", version=5, seed=2, scale=0.5)
    engine = resident.engine_for("torch", DEMO_DIR)
    prompts = [f"{a}+{b}=" for a in range(10, 30) for b in (11, 47)]
    resident.serve(engine, 1, 5, a5)
    from_a = greedy(engine, prompts)
    resident.serve(engine, 2, 5, b5)  # same number, other run: must switch
    assert resident.serves(engine) == (2, 5)
    from_b = greedy(engine, prompts)
    assert from_a != from_b
    resident.serve(engine, 1, 5, a5)
    assert greedy(engine, prompts) == from_a
    resident.serve(engine, 2, 0, None)  # version 0 is the base model, whichever run asks
    assert resident.serves(engine) == (None, 0)


def test_the_least_recently_used_are_evicted_to_stay_within_the_budget(monkeypatch: pytest.MonkeyPatch):
    from workers.policy.trainer import TrainerConfig

    engine = resident.engine_for("torch", DEMO_DIR)
    one_model = resident.resident_bytes()
    assert one_model > 2**20  # the demo model's float32 parameters
    cfg = TrainerConfig(lora_rank=8)
    resident.trainer_for(1, DEMO_DIR, cfg, None, 0, 0)
    with_trainer = resident.resident_bytes()
    # room for about two models: a second trainer pushes out the least recently used (the engine)
    monkeypatch.setenv("TEMPER_RESIDENT_MB", str((with_trainer + one_model // 2) / 2**20))
    resident.trainer_for(2, DEMO_DIR, cfg, None, 0, 0)
    assert resident.resident_bytes() <= resident.budget_bytes()
    assert not resident._ENGINES and set(resident._TRAINERS) == {1, 2}
    # the engine comes back when asked for (loaded again), evicting the trainer used longest ago
    again = resident.engine_for("torch", DEMO_DIR)
    assert again is not engine and resident.resident_bytes() <= resident.budget_bytes()
    assert set(resident._TRAINERS) == {2}
    snapshot = resident.snapshot()
    assert snapshot["engines"] and snapshot["resident_mb"] <= snapshot["budget_mb"]


def test_placement_follows_temper_device(monkeypatch: pytest.MonkeyPatch):
    from workers.policy.device import DeviceUnavailable, resolve

    monkeypatch.setenv("TEMPER_DEVICE", "cpu")
    assert resolve().describe() == "cpu float32"
    monkeypatch.setenv("TEMPER_DEVICE", "auto")
    import torch

    assert resolve().device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("TEMPER_DEVICE", "tpu")
    with pytest.raises(DeviceUnavailable, match="not a device"):
        resolve()
    if not torch.cuda.is_available():
        monkeypatch.setenv("TEMPER_DEVICE", "cuda:1")
        with pytest.raises(DeviceUnavailable, match="sees no CUDA device"):
            resolve()
