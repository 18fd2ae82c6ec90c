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


def test_a_version_saved_anew_under_its_number_is_served_anew(tmp_path: Path):
    """A step given up after its version was saved (its record failed) is trained again and saved under the
    same number: an engine that still serves (run, number) must load the new copy, not keep the old one."""
    import shutil

    engine = resident.engine_for("torch", DEMO_DIR)
    prompts = [f"{a}+{b}=" for a in range(10, 30) for b in (11, 47)]
    v1 = tmp_path / "runs" / "1" / "v1"
    make_lora_version(DEMO_DIR, v1, version=1, seed=1, scale=0.5)
    resident.serve(engine, 1, 1, v1)
    abandoned = greedy(engine, prompts)
    shutil.rmtree(v1)
    make_lora_version(DEMO_DIR, v1, version=1, seed=2, scale=0.5)  # the step trained again, saved again
    resident.serve(engine, 1, 1, v1)
    again = greedy(engine, prompts)
    assert again != abandoned
    fresh = resident.engine_for("torch", DEMO_DIR, seed=1)  # another engine, loading only the new copy
    resident.serve(fresh, 1, 1, v1)
    assert greedy(fresh, prompts) == again


def test_a_second_delivery_of_a_train_step_in_the_same_process_trains_nothing():
    """``run_step`` trains a run's step only if this process is not training one of that run already (a
    message delivered twice, or re-sent while a step trained ahead was being recorded); a second copy would
    train it beside the first and save over its version's files."""
    from webapp.runs.loop import training

    with resident.training(7) as first:
        assert first is not None
        with resident.training(7, exclusive=True) as second:
            assert second is None
        # nothing of the run is read: the step under way is left alone, and still registered
        assert training.run_step(7, 3, "gpu@test") is None
        assert resident._STEPS[7] is first
    with resident.training(7, exclusive=True) as third:
        assert third is not None and resident._STEPS[7] is third
    assert 7 not in resident._STEPS


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
