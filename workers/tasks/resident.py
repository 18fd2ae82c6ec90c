"""What a GPU worker keeps in memory between tasks: one engine per base model, one trainer per run.

The device is used by one task at a time (``device()``). A GPU worker may run two tasks at once
(``--pool threads --concurrency 2``): while one computes, the other reads its batch from the database or
writes its results, so the device does not wait on bookkeeping.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from workers.telemetry import Timer, busy

_ENGINES: dict[tuple[str, str], Any] = {}
_TRAINERS: dict[int, Any] = {}
_DEVICE = threading.Lock()
_STEPS: dict[int, threading.Event] = {}  # run id -> set when that run's train step here is recorded
_STEPS_LOCK = threading.Lock()


@contextmanager
def training(run_id: int) -> Iterator[None]:
    """A train step of the run is under way in this process until its version is recorded."""
    done = threading.Event()
    with _STEPS_LOCK:
        _STEPS[run_id] = done
    try:
        yield
    finally:
        with _STEPS_LOCK:
            if _STEPS.get(run_id) is done:
                del _STEPS[run_id]
        done.set()


def after_training(run_id: int, timeout: float = 120.0) -> None:
    """Wait for the run's train step under way in this process, if any: prompts admitted while it trained
    (async mode admits ahead) are meant for the version it produces."""
    with _STEPS_LOCK:
        done = _STEPS.get(run_id)
    if done is not None:
        done.wait(timeout)


@contextmanager
def device(run_id: int | None) -> Iterator[Timer]:
    """Hold the device for a stretch of work (generating, training, switching or saving weights); the time
    it is held counts as GPU-busy for this worker and the run. Engines and trainers are only used inside."""
    with _DEVICE, busy(run_id) as timer:
        yield timer


def _cpu_threads() -> None:
    """On a shared CPU, one torch thread per worker beat two by ~7x per GRPO step (measured on 2 cores)."""
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("TEMPER_TORCH_THREADS", "1")))


def engine_for(name: str, base_model_dir: Path, seed: int = 0) -> Any:
    from workers.policy.engines import load_engine

    _cpu_threads()
    key = (name, str(base_model_dir))
    if key not in _ENGINES:
        _ENGINES[key] = load_engine(name, base_model_dir, seed=seed)
    return _ENGINES[key]


def trainer_for(run_id: int, base_model_dir: Path, config: Any, version_dir: Path | None, version: int,
                step: int) -> Any:
    """The run's resident trainer; rebuilt from the newest saved version if it is missing or behind."""
    from workers.policy.trainer import Trainer

    trainer = _TRAINERS.get(run_id)
    if trainer is None or trainer.version != version:
        trainer = Trainer(base_model_dir, config, version_dir=version_dir)
        trainer.version, trainer.step = version, step
        _TRAINERS[run_id] = trainer
    return trainer
