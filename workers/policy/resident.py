"""What a GPU worker keeps in memory between tasks: engines (one per base model) and trainers (one per run).

Several runs share a GPU worker, and two runs on one base model share its engine, so a resident engine
knows *whose* version it serves: a version is named by (run, number), never by its number alone (run B
at version 5 must not sample from run A's version 5). Version 0 is the base model itself, the same for
every run.

Engines and trainers stay within a memory budget (``TEMPER_RESIDENT_MB``, default 8192: the bytes of
their parameters, and for a trainer its gradients and AdamW moments too). When a new one would exceed
it, the least recently used are evicted first; an evicted trainer is rebuilt from its run's newest saved
version (with a fresh optimizer, as after a worker restart).

Everything is placed on ``TEMPER_DEVICE`` (``workers.policy.device``). The device is used by one task
at a time (hold ``DEVICE``; ``webapp.runs.loop.live.on_device`` also times it). A GPU worker may run two
tasks at once (``--pool threads --concurrency 2``): while one computes, the other reads its batch from the
database or writes its results, so the device does not wait on bookkeeping.

Pure: no Django (torch is imported where an engine or trainer is built).
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

DEVICE = threading.Lock()
"""Held for every stretch of device work: one task on the device at a time."""
_STEPS: dict[int, threading.Event] = {}  # run id -> set when that run's train step here is recorded
_STEPS_LOCK = threading.Lock()
_WARM_UP: threading.Thread | None = None


@dataclass
class _Resident:
    obj: Any
    bytes: int
    serves: tuple[int | None, int] = (None, 0)
    """(run id, version number) an engine currently serves; (None, 0) is the base model."""
    used: float = 0.0


_ENGINES: OrderedDict[tuple[str, str, str], _Resident] = OrderedDict()
_TRAINERS: OrderedDict[int, _Resident] = OrderedDict()
_PLACEMENT: Any = None


def budget_bytes() -> int:
    return int(float(os.environ.get("TEMPER_RESIDENT_MB", "8192")) * 2**20)


def placement() -> Any:
    """Where this worker runs its engines and trainers (``TEMPER_DEVICE``), resolved once per process."""
    global _PLACEMENT
    if _PLACEMENT is None:
        from workers.policy.device import resolve

        _PLACEMENT = resolve()
    return _PLACEMENT


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


def _cpu_threads() -> None:
    """On a shared CPU, one torch thread per worker beat two by ~7x per GRPO step (measured on 2 cores).

    The GIL's switch interval drops from 5 ms to 0.5 ms (``TEMPER_SWITCH_INTERVAL_S``): the device thread lets
    go of the GIL at every tensor op, and each time the worker's other task thread (writing samples, reading
    a batch: Python) could keep it for up to the interval, so device stretches ran ~1.4x their CPU time; at
    0.5 ms ~1.2x, and the demo's full system steps 2.65 -> 3.02 a second (``bench/demo.py``)."""
    import sys

    import torch

    if not placement().is_cuda:
        torch.set_num_threads(int(os.environ.get("TEMPER_TORCH_THREADS", "1")))
    sys.setswitchinterval(float(os.environ.get("TEMPER_SWITCH_INTERVAL_S", "0.0005")))


def warm_up() -> threading.Thread:
    """Import torch, transformers and the engine and trainer modules on a thread of their own, as the worker
    starts: ~4 s of imports on this machine that the first rollout task would otherwise wait for (the demo's
    first held-out evaluation came 5 s after the worker was ready). ``engine_for`` and ``trainer_for`` wait
    for it to finish (``_warmed``): transformers' lazy attributes are not safe to resolve from two threads at
    once (a first ``generate`` racing it raised ``cannot import name 'AutoModelForCausalLM'``). An import
    error is raised again in the task, where it is seen."""
    global _WARM_UP

    def imports() -> None:
        import contextlib

        with contextlib.suppress(Exception):
            import transformers

            import workers.policy.torch_engine
            import workers.policy.trainer  # noqa: F401

            # transformers imports lazily: naming these loads what from_pretrained and generate use, and what
            # every decoder architecture's module imports (its layers and activations: ~0.3 s more)
            transformers.AutoModelForCausalLM, transformers.AutoTokenizer, transformers.GenerationMixin  # noqa: B018
            transformers.PreTrainedModel  # noqa: B018
            import transformers.activations
            import transformers.modeling_layers

            # a version is written at every train step: its "Writing model shards" bar filled the worker's log
            transformers.utils.logging.disable_progress_bar()

    thread = _WARM_UP = threading.Thread(target=imports, name="temper-warm-up", daemon=True)
    thread.start()
    return thread


def _warmed() -> None:
    """Wait for ``warm_up``'s imports, if they were started."""
    if _WARM_UP is not None:
        _WARM_UP.join()


def _param_bytes(module: Any, trainable_factor: int = 0) -> int:
    """Parameter bytes, plus ``trainable_factor`` times the trainable ones (gradients, AdamW moments)."""
    total = trainable = 0
    for p in module.parameters():
        size = p.numel() * p.element_size()
        total += size
        if p.requires_grad:
            trainable += size
    return total + trainable_factor * trainable


def resident_bytes() -> int:
    return sum(r.bytes for r in (*_ENGINES.values(), *_TRAINERS.values()))


def _make_room(incoming: int, keep: object) -> None:
    """Evict the least recently used engines and trainers until ``incoming`` more bytes fit the budget."""
    while resident_bytes() + incoming > budget_bytes():
        tables: tuple[OrderedDict[Any, _Resident], ...] = (_ENGINES, _TRAINERS)
        candidates = [(r.used, table, key) for table in tables for key, r in table.items() if r is not keep]
        if not candidates:
            return  # one object larger than the budget: keep it rather than fail the work
        _, table, key = min(candidates, key=lambda c: c[0])
        evicted = table.pop(key)
        close = getattr(evicted.obj, "close", None)
        if callable(close):
            close()
        del evicted
        _free_device_memory()


def _free_device_memory() -> None:
    import gc

    gc.collect()
    if placement().is_cuda:
        import torch

        torch.cuda.empty_cache()


def engine_for(name: str, base_model_dir: Path, seed: int = 0, chat_template: str = "") -> Any:
    """The resident engine of a base model (loaded on first use, on this worker's device); a registered
    ``chat_template`` replaces its tokenizer's own (one resident engine per template)."""
    from workers.policy.chat import apply_override
    from workers.policy.device import torch_dtype
    from workers.policy.engines import load_engine

    _warmed()
    _cpu_threads()
    key = (name, str(base_model_dir), chat_template)
    found = _ENGINES.get(key)
    if found is None:
        where = placement()
        options: dict[str, Any] = {"dtype": torch_dtype(where)} if name == "torch" else {
            "dtype": where.dtype}
        engine = load_engine(name, base_model_dir, device=where.device, seed=seed, **options)
        apply_override(engine.tokenizer, chat_template)
        model = getattr(engine, "model", None)
        size = _param_bytes(model) if model is not None else 0
        _make_room(size, None)
        found = _ENGINES[key] = _Resident(engine, size)
    found.used = time.monotonic()
    _ENGINES.move_to_end(key)
    return found.obj


def serve(engine: Any, run_id: int, version: int, version_dir: Path | None) -> None:
    """Point a resident engine at version ``version`` of run ``run_id`` unless it serves exactly that."""
    wanted = (None, 0) if version == 0 else (run_id, version)
    for resident in _ENGINES.values():
        if resident.obj is engine:
            if resident.serves != wanted:
                engine.set_version(version_dir)
                resident.serves = wanted
            return
    engine.set_version(version_dir)  # not one of ours (a test's own engine): no memory of what it serves


def serves(engine: Any) -> tuple[int | None, int] | None:
    return next((r.serves for r in _ENGINES.values() if r.obj is engine), None)


def trainer_for(run_id: int, base_model_dir: Path, config: Any, version_dir: Path | None, version: int,
                step: int) -> Any:
    """The run's resident trainer; rebuilt from the newest saved version if it is missing or behind."""
    _warmed()
    from workers.policy.trainer import Trainer

    where = placement()
    config = replace(config, device=where.device, autocast=where.dtype)
    found = _TRAINERS.get(run_id)
    if found is None or found.obj.version != version:
        if found is not None:
            del _TRAINERS[run_id]
        trainer = Trainer(base_model_dir, config, version_dir=version_dir)
        trainer.version, trainer.step = version, step
        size = _param_bytes(trainer.model, trainable_factor=3)
        _make_room(size, None)
        found = _TRAINERS[run_id] = _Resident(trainer, size)
    found.used = time.monotonic()
    _TRAINERS.move_to_end(run_id)
    return found.obj


def snapshot() -> dict[str, Any]:
    """What is resident now (for the heartbeat and for tests)."""
    return {
        "engines": [{"engine": k[0], "base_model": k[1], "serves": list(r.serves), "mb": round(r.bytes / 2**20, 1)}
                    for k, r in _ENGINES.items()],
        "trainers": [{"run": k, "version": r.obj.version, "mb": round(r.bytes / 2**20, 1)}
                     for k, r in _TRAINERS.items()],
        "budget_mb": round(budget_bytes() / 2**20), "resident_mb": round(resident_bytes() / 2**20, 1),
    }
