"""What a GPU worker keeps in memory between tasks: engines (one per base model) and trainers (one per run).

Several runs share a GPU worker, and two runs on one base model share its engine, so a resident engine
knows *whose* version it serves: a version is named by (run, number), never by its number alone (run B
at version 5 must not sample from run A's version 5). Version 0 is the base model itself, the same for
every run.

Engines and trainers stay within a memory budget (``TEMPER_RESIDENT_MB``, default 8192: the bytes of
their parameters, and for a trainer its gradients and AdamW moments too). When a new one would exceed
it, the least recently used are evicted first; an evicted trainer is rebuilt from its run's newest saved
version (with a fresh optimizer, as after a worker restart).

Everything is placed on ``TEMPER_DEVICE`` (``workers.policy.device``). The loop asks for device work in
two requests: ``rollout`` (encode prompts, leave out those the model's context cannot take, switch to a
version, sample, and judge with a string verifier where asked) and ``train`` (one step: advantages where the
batch is assembled, the trainer's step, the version saved). A GPU worker may run two tasks at once
(``--pool threads --concurrency 2``): while one computes, the other reads its batch from the database or
writes its results, so the device does not wait on bookkeeping.

In a GPU worker the engines and trainers live in a device process of its own
(``workers.policy.device_process``, registered here by ``use_remote``): these functions then send it their
requests, which it carries out one at a time in the order they come (its queue is the device's lock), and
``rollout_async``/``train_async`` queue one without waiting, so a step can follow its rollout on the device
at once (``webapp.runs.loop.training.plan_ahead``). This module's tables are then the child's. Elsewhere
(tests, benches, a script) they are this process's, and ``DEVICE`` keeps one task on the device at a time
(``holding_device``; ``webapp.runs.loop.live.on_device`` also times it).

Pure: no Django (torch is imported where an engine or trainer is built).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

DEVICE = threading.Lock()
"""Held for every stretch of device work: one task on the device at a time."""
_STEPS: dict[int, TrainStep] = {}  # run id -> its train step under way in this process
_STEPS_LOCK = threading.Lock()
_WARM_UP: threading.Thread | None = None


@dataclass
class _Resident:
    obj: Any
    bytes: int
    serves: tuple[int | None, int] = (None, 0)
    """(run id, version number) an engine currently serves; (None, 0) is the base model."""
    stamp: tuple[int, int] | None = None
    """Which copy of that version's files it loaded (``_stamp``)."""
    used: float = 0.0


_ENGINES: OrderedDict[tuple[str, str, str], _Resident] = OrderedDict()
_TRAINERS: OrderedDict[int, _Resident] = OrderedDict()
_PLACEMENT: Any = None


class Remote(Protocol):
    """Where the engines and trainers are when not in this process (``device_process.DeviceClient``). Its
    futures hold ``(value, seconds, cpu seconds)`` of the request."""

    def engine_for(self, name: str, base_model_dir: Path, seed: int = ..., chat_template: str = ...) -> Any: ...

    def serve(self, engine: Any, run_id: int, version: int, version_dir: Path | None) -> None: ...

    def submit_rollout(self, engine: Any, prompts: list[Any], sampling: Any, serve: Serve | None,
                       judges: list[Judge | None] | None, keep: str | None) -> Future[Any]: ...

    def submit_train(self, run_id: int, base_model_dir: Path, config: Any, base: Serve, step: int,
                     batch: list[tuple[list[Any], list[float | None]]] | None, kept: tuple[str, list[int]] | None,
                     out_dir: Path, spec_hash: str | None) -> Future[Any]: ...

    def drop_trainer(self, run_id: int) -> None: ...

    def resolved_placement(self, wait: bool = ...) -> Any: ...

    def snapshot(self) -> dict[str, Any]: ...


_REMOTE: Remote | None = None


def use_remote(remote: Remote | None) -> None:
    """Hand out ``remote``'s engines and trainers from now on (None: this process's own again)."""
    global _REMOTE
    _REMOTE = remote


def budget_bytes() -> int:
    return int(float(os.environ.get("TEMPER_RESIDENT_MB", "8192")) * 2**20)


def placement(wait: bool = True) -> Any:
    """Where this worker runs its engines and trainers (``TEMPER_DEVICE``), resolved once per process; with
    ``wait`` False, None while a device process has not said yet (it is starting)."""
    global _PLACEMENT
    if _REMOTE is not None:
        return _REMOTE.resolved_placement(wait)
    if _PLACEMENT is None:
        from workers.policy.device import resolve

        _PLACEMENT = resolve()
    return _PLACEMENT


@dataclass
class TrainStep:
    """A train step of one run under way in this process. ``usable`` is set once its version may be asked
    for — with ``version`` (number, directory) and ``step`` when that is before the step is recorded: a step
    confirmed as it is queued in the device process (``webapp.runs.loop.training._run_step``) or trained ahead
    and confirmed (``conclude_ahead``), whose version the device process saves before any request queued
    after its own — and ``recorded`` once it is recorded or given up."""

    usable: threading.Event = field(default_factory=threading.Event)
    recorded: threading.Event = field(default_factory=threading.Event)
    version: tuple[int, Path] | None = None
    step: int | None = None
    ok: bool = False
    """Set when its version is recorded (before ``recorded``): a confirmed step can still be given up (its
    record failed), and samples taken from its version must then not be written."""

    def confirm(self, step: int, number: int, version_dir: Path) -> None:
        self.step, self.version = step, (number, version_dir)
        self.usable.set()


@contextmanager
def training(run_id: int, exclusive: bool = False) -> Iterator[TrainStep | None]:
    """A train step of the run is under way in this process until its version is recorded. ``exclusive``:
    yields None, and registers nothing, when one is under way already (a second delivery of its message)."""
    step = TrainStep()
    with _STEPS_LOCK:
        taken = exclusive and run_id in _STEPS
        if not taken:
            _STEPS[run_id] = step
    if taken:
        yield None
        return
    try:
        yield step
    finally:
        with _STEPS_LOCK:
            if _STEPS.get(run_id) is step:
                del _STEPS[run_id]
        step.usable.set()
        step.recorded.set()


def after_training(run_id: int, timeout: float = 120.0) -> TrainStep | None:
    """Wait until the version of the run's train step under way in this process, if any, may be asked for:
    prompts admitted while it trained (async mode admits ahead) are meant for the version it produces.
    Returns the step when it is confirmed but not yet recorded (its ``version`` is then the one to sample
    from, and ``recorded`` says when samples of it may be written)."""
    with _STEPS_LOCK:
        step = _STEPS.get(run_id)
    if step is None:
        return None
    step.usable.wait(timeout)
    return step if step.version is not None and not step.ok and not step.recorded.is_set() else None


def recorded(run_id: int, timeout: float = 120.0) -> None:
    """Wait until the run's train step under way in this process, if any, is recorded (or given up)."""
    with _STEPS_LOCK:
        step = _STEPS.get(run_id)
    if step is not None:
        step.recorded.wait(timeout)


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


def device_cpus(env: Mapping[str, str] | None = None) -> frozenset[int] | None:
    """The CPUs a device process keeps for itself (``TEMPER_DEVICE_CPUS``): ``auto``, the default, is the last
    ``TEMPER_TORCH_THREADS`` of the CPUs this process may use, when it may use more and the device is the
    CPU (``TEMPER_DEVICE`` not CUDA, or ``auto`` on a machine without an NVIDIA driver); a list such as ``3``
    or ``2,3``; ``none``. None when not pinned. Pure: no torch (``manage.py up`` asks it before any role
    starts, to keep the others off those CPUs). ``env``: the environment to read, this process's by default."""
    env = os.environ if env is None else env
    spec = (env.get("TEMPER_DEVICE_CPUS") or "auto").strip().lower()
    if spec == "none":
        return None
    if spec != "auto":
        return frozenset(int(c) for c in spec.split(",") if c.strip())
    device = (env.get("TEMPER_DEVICE") or "auto").strip().lower()
    if device.startswith("cuda") or (device == "auto" and Path("/dev/nvidiactl").exists()):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    threads = int(env.get("TEMPER_TORCH_THREADS") or 1)
    return frozenset(allowed[-threads:]) if len(allowed) > threads else None


def pin_device_cpus() -> frozenset[int] | None:
    """Keep this process — a device process, from its start: its imports run there too — on its CPUs
    (``device_cpus``). Threads it starts later (torch's) inherit them. Returns the CPUs, or None.

    *Why:* moved between cores by the scheduler as the worker's bookkeeping, the database and the web server
    came and went, the demo model's requests ran ~25 % slower in CPU time than in a process alone (a rollout
    70 ms, a step with its save 187 ms, against 54 and 147); pinned, 50-53 and 151-153 ms, and
    ``bench/demo.py``'s full system went from 3.4-3.6 to 4.2 steps a second. ``manage.py up`` also keeps
    every other process but the sandbox workers (at nice 10, below the device) off those CPUs: the web
    server, the control worker and the GPU worker's own bookkeeping otherwise preempted the device."""
    cpus = device_cpus()
    if cpus:
        os.sched_setaffinity(0, cpus)
    return cpus


def keep_off_device_cpus() -> None:
    """Keep every thread of this process off the device process's CPUs (the GPU worker, once its device
    process is started: its bookkeeping, like every other process's, runs beside the device, not on it)."""
    cpus = device_cpus()
    rest = set(os.sched_getaffinity(0)) - set(cpus or ())
    if not cpus or not rest:
        return
    for tid in _threads():
        with contextlib.suppress(OSError):  # a thread that has ended since
            os.sched_setaffinity(tid, rest)


def _threads() -> set[int]:
    """This process's threads (Linux keeps a nice value and a CPU affinity per thread)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:  # not Linux: the process's own
        return {0}


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
    if _REMOTE is not None:
        return _REMOTE.engine_for(name, base_model_dir, seed, chat_template)
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


def _stamp(version_dir: Path | None) -> tuple[int, int] | None:
    """Which copy of a version's files ``version_dir`` holds: its metadata file's inode and mtime. A step given
    up after it was saved (its record failed) is trained again and saved anew under the same number; an
    engine that compared (run, number) only kept serving the abandoned copy."""
    if version_dir is None:
        return None
    try:
        st = os.stat(Path(version_dir) / "metadata.json")
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def serve(engine: Any, run_id: int, version: int, version_dir: Path | None) -> None:
    """Point a resident engine at version ``version`` of run ``run_id`` unless it serves exactly that copy."""
    if _REMOTE is not None:
        _REMOTE.serve(engine, run_id, version, version_dir)
        return
    wanted = (None, 0) if version == 0 else (run_id, version)
    stamp = _stamp(version_dir) if version else None
    for resident in _ENGINES.values():
        if resident.obj is engine:
            if resident.serves != wanted or resident.stamp != stamp:
                engine.set_version(version_dir)
                resident.serves, resident.stamp = wanted, stamp
            return
    engine.set_version(version_dir)  # not one of ours (a test's own engine): no memory of what it serves


def serves(engine: Any) -> tuple[int | None, int] | None:
    return next((r.serves for r in _ENGINES.values() if r.obj is engine), None)


def trainer_for(run_id: int, base_model_dir: Path, config: Any, version_dir: Path | None, version: int,
                step: int) -> Any:
    """The run's resident trainer (in this process); rebuilt from the newest saved version if it is missing or
    behind."""
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


Serve = tuple[int, int, Path | None]
"""(run id, version number, version directory): the version a request samples from or trains on."""


@dataclass(frozen=True)
class Judge:
    """How ``rollout`` judges one prompt's samples as they are generated: a string verifier
    (``webapp.runs.loop.verification.INLINE_KINDS``) with its configuration, and the task's reference and
    domain kind."""

    kind: str | None
    """The verifier kind; None when the domain has none (every verdict invalid, saying so)."""
    config: dict[str, Any]
    reference: Any
    domain_kind: str | None


@dataclass
class Rollout:
    """What ``rollout`` gives."""

    samples: list[Any]
    """Of the prompts kept, prompt-major (``sampling.n`` each)."""
    kept: list[int]
    """The indices of the prompts generated."""
    too_long: dict[int, int]
    """Prompts refused, with their tokens: they leave no room in the model's context for ``max_tokens``."""
    context: int
    """The model's context in tokens (0 when the engine does not say)."""
    judged: list[tuple[list[Any], float] | None] | None = None
    """Per kept prompt, when ``judges`` were given: its samples' verdicts and the seconds judging took (None
    for a prompt without a judge)."""


_KEPT: OrderedDict[str, Rollout] = OrderedDict()
"""Rollouts kept for a step trained ahead (``rollout_async(keep=...)``), by token; the few newest."""


def rollout(engine: Any, prompts: list[Any], sampling: Any, *, serve: Serve | None = None,
            judges: list[Judge | None] | None = None) -> Rollout:
    """Sample ``sampling.n`` completions of each prompt that fits the model's context, under ``serve``
    (the engine's current version when None), and judge them where ``judges`` say how."""
    if _REMOTE is not None:
        return wait(_REMOTE.submit_rollout(engine, prompts, sampling, serve, judges, None))
    return _rollout(engine, prompts, sampling, serve, judges, None)


def rollout_async(engine: Any, prompts: list[Any], sampling: Any, *, serve: Serve | None,
                  judges: list[Judge | None] | None, keep: str) -> Future[Any]:
    """``rollout`` queued in the device process without waiting, its result kept there under ``keep`` for a
    ``train_async`` queued next (``result`` reads the future)."""
    if _REMOTE is None:
        raise RuntimeError("queueing device work needs the device process (workers.policy.device_process)")
    return _REMOTE.submit_rollout(engine, prompts, sampling, serve, judges, keep)


def context_tokens(engine: Any) -> int:
    """The model's context in tokens (``Engine.max_context``; 0 when the engine does not say)."""
    return int(getattr(engine, "max_context", 0) or 0)


def _rollout(engine: Any, prompts: list[Any], sampling: Any, serve_: Serve | None, judges: list[Judge | None] | None,
             keep: str | None) -> Rollout:
    from workers.policy.chat import prompt_text
    from workers.policy.engines import encode_prompts
    from workers.verifiers.base import JudgeInput, judge_all

    contexts = encode_prompts(engine.tokenizer, prompts)
    limit = context_tokens(engine)
    too_long = {i: len(ids) for i, ids in enumerate(contexts) if limit and len(ids) + sampling.max_tokens > limit}
    kept = [i for i in range(len(prompts)) if i not in too_long]
    if serve_ is not None:
        serve(engine, *serve_)
    samples = list(engine.generate_ids([contexts[i] for i in kept], sampling)) if kept else []
    out = Rollout(samples=samples, kept=kept, too_long=too_long, context=limit)
    if judges is not None:
        out.judged = []
        for n, i in enumerate(kept):
            judge = judges[i]
            if judge is None:
                out.judged.append(None)
                continue
            started = time.monotonic()
            verdicts = judge_all(judge.kind, judge.config, [
                JudgeInput(prompt=prompt_text(prompts[i]), completion=s.text, reference=judge.reference,
                           kind=judge.domain_kind) for s in samples[n * sampling.n:(n + 1) * sampling.n]])
            out.judged.append((verdicts, time.monotonic() - started))
    if keep is not None:
        _KEPT[keep] = out
        while len(_KEPT) > 8:  # one whose step was never sent
            _KEPT.popitem(last=False)
    return out


def train(run_id: int, base_model_dir: Path, config: Any, base: Serve, step: int,
          batch: list[tuple[list[Any], list[float | None]]], out_dir: Path, spec_hash: str | None) -> Any:
    """One train step of the run from version ``base`` (its trainer rebuilt from it if the resident one is
    elsewhere; ``step`` is the run's step count before this one): each group's advantages computed from its
    rewards (``losses.sample_advantages``, None for an invalid verdict), the trainer's step on them, and the
    version it makes saved in ``out_dir``. ``batch``: per group, its samples and rewards. A
    ``steps.StepResult``."""
    if _REMOTE is not None:
        return wait(_REMOTE.submit_train(run_id, base_model_dir, config, base, step, batch, None, out_dir,
                                             spec_hash))
    return _train(run_id, base_model_dir, config, base, step, batch, None, out_dir, spec_hash)


def submit_train(run_id: int, base_model_dir: Path, config: Any, base: Serve, step: int,
                 batch: list[tuple[list[Any], list[float | None]]], out_dir: Path, spec_hash: str | None) -> Future[Any]:
    """``train`` queued in the device process without waiting (``wait`` reads it): requests queued after it
    run after its version is saved, so a rollout of that version can be queued behind it at once."""
    if _REMOTE is None:
        raise RuntimeError("queueing device work needs the device process (workers.policy.device_process)")
    return _REMOTE.submit_train(run_id, base_model_dir, config, base, step, batch, None, out_dir, spec_hash)


def train_async(run_id: int, base_model_dir: Path, config: Any, base: Serve, step: int, kept: tuple[str, list[int]],
                out_dir: Path, spec_hash: str | None) -> Future[Any]:
    """``train`` queued in the device process without waiting, on the rollout it kept under ``kept[0]`` (its
    prompts in the order ``kept[1]``, each prompt a group): a step trained ahead. Its result is None, and
    nothing trained, when that rollout left a prompt out, has a verdict that is invalid or missing, or was
    not kept."""
    if _REMOTE is None:
        raise RuntimeError("queueing device work needs the device process (workers.policy.device_process)")
    return _REMOTE.submit_train(run_id, base_model_dir, config, base, step, None, kept, out_dir, spec_hash)


def _train(run_id: int, base_model_dir: Path, config: Any, base: Serve, step: int,
           batch: list[tuple[list[Any], list[float | None]]] | None, kept: tuple[str, list[int]] | None,
           out_dir: Path, spec_hash: str | None) -> Any:
    from workers.policy.losses import sample_advantages
    from workers.policy.steps import Group, StepResult

    if batch is None:
        assert kept is not None
        token, order = kept
        out = _KEPT.pop(token, None)
        if out is None or out.too_long or out.judged is None or len(out.kept) != len(order):
            return None
        n = len(out.samples) // max(1, len(out.kept))
        batch = []
        for i in order:
            judged = out.judged[i]
            if judged is None or not all(v.is_valid for v in judged[0]):
                return None
            batch.append((out.samples[i * n:(i + 1) * n], [v.score for v in judged[0]]))
    advantages = [sample_advantages(list(rewards), config.advantage) for _, rewards in batch]
    trainer = trainer_for(run_id, base_model_dir, config, base[2], base[1], step)
    metrics = trainer.train_step([Group(samples=samples, rewards=rewards, advantages=adv)
                                  for (samples, rewards), adv in zip(batch, advantages, strict=True)])
    meta = trainer.save_version(out_dir, spec_hash=spec_hash)
    return StepResult(metrics=metrics, version=meta.version, advantages=advantages)


_charges = threading.local()


def wait(future: Future[Any]) -> Any:
    """A queued request's value, waiting for it; its seconds and CPU seconds are charged to the calling
    thread (``device_time``, what ``live.on_device`` times)."""
    value, seconds, cpu = future.result()
    _charges.seconds = getattr(_charges, "seconds", 0.0) + seconds
    _charges.cpu = getattr(_charges, "cpu", 0.0) + cpu
    return value


def result(future: Future[Any]) -> tuple[Any, float, float]:
    """A queued request's ``(value, seconds, cpu seconds)``, waiting for it (charged to nobody: the caller
    accounts for it)."""
    return future.result()


def device_time() -> tuple[float, float]:
    """Device seconds and CPU seconds so far, to time a stretch of device work by difference: with a device
    process, what it reported for this thread's requests (a request waiting behind another's is not
    counted); else this thread's clock and CPU time."""
    if _REMOTE is not None:
        return getattr(_charges, "seconds", 0.0), getattr(_charges, "cpu", 0.0)
    return time.monotonic(), time.thread_time()


def holding_device() -> Any:
    """A context holding the device for a stretch of work in this process (``DEVICE``); with a device
    process, none: its queue keeps one request on the device at a time."""
    return contextlib.nullcontext() if _REMOTE is not None else DEVICE


def can_queue() -> bool:
    """Whether device work can be queued without waiting (``rollout_async``, ``train_async``)."""
    return _REMOTE is not None


def drop_trainer(run_id: int) -> None:
    """Forget the run's resident trainer; the next step rebuilds it from the run's newest saved version (a
    step trained ahead and not recorded left it a step ahead of the run)."""
    if _REMOTE is not None:
        _REMOTE.drop_trainer(run_id)
    else:
        _TRAINERS.pop(run_id, None)


def snapshot() -> dict[str, Any]:
    """What is resident now (for the heartbeat and for tests)."""
    if _REMOTE is not None:
        return _REMOTE.snapshot()
    return {
        "engines": [{"engine": k[0], "base_model": k[1], "serves": list(r.serves), "mb": round(r.bytes / 2**20, 1)}
                    for k, r in _ENGINES.items()],
        "trainers": [{"run": k, "version": r.obj.version, "mb": round(r.bytes / 2**20, 1)}
                     for k, r in _TRAINERS.items()],
        "budget_mb": round(budget_bytes() / 2**20), "resident_mb": round(resident_bytes() / 2**20, 1),
    }
