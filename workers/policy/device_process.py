"""The device process: a GPU worker's resident engines and trainers, and every stretch of device work, in a
process of its own.

Why: a GPU worker runs two task threads, one on the device while the other reads a batch, writes samples,
claims work and sends messages. In one process they shared one GIL, and a small model's device work is
mostly Python too (its modules, autograd, the sampling loop): the worker never used more than one core,
and every stretch of device work waited on its sibling's bookkeeping (measured on the demo run: the GPU
worker's CPU time per step equalled its wall time, ~0.09 s of it bookkeeping; with a Python thread at 25 %
duty in the same process a generate took 121 ms against 92 alone, against 94 with that thread in another
process). Here the device work has a GIL and a core of its own, and the worker's bookkeeping runs beside it
on another core. vLLM's V1 engine core stands apart from its API server for the same reason.

How: the worker starts ``python -m workers.policy.device_process FD PARENT`` with one end of a socket pair,
and the child serves requests one at a time, in the order they arrive (its queue is the device's lock):
``rollout`` (encode prompts, leave out those the context cannot take, switch to a version, sample, judge
with a string verifier where asked), ``train`` (advantages, the trainer's step, the version saved),
``generate_ids`` (a multi-turn episode's turn), and ``load``, ``placement``, ``snapshot``,
``drop_trainer``. Requests and answers are pickled (``multiprocessing.connection``). The real engines and
trainers are ``workers.policy.resident``'s, in the child; ``start()`` registers the client with
``resident.use_remote``, which then sends the loop's requests here and hands out ``RemoteEngine`` proxies,
so the loop's code is the same in either mode. Each answer carries the request's seconds and CPU seconds:
what ``resident.device_time`` charges to the thread that waited for it (GPU-busy, the fair share, the
profile), a request queued behind another's not counting that wait.

Lifecycle: started as the worker starts (its imports overlap the worker's own start), it ends when its
socket closes — the worker exited, even killed, since the kernel closes the socket with the process — and
it ignores the terminal's Ctrl-C (the worker stops first, then it). A child that dies (killed, out of
memory) fails the requests in flight with ``DeviceProcessLost`` and is started again at the next request;
its engines and trainers are loaded again on first use (a trainer from the run's newest saved version, with
a fresh optimizer, as after a worker restart).

Not covered: several devices per worker (one GPU worker per GPU, as before); a device shared by several
worker processes; a tokenizer in the worker for single-turn work (prompts are encoded by the child; a
multi-turn episode, which encodes observations turn by turn, loads one in the worker on first use).

Pure: no Django.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from workers.policy import resident

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[2]


class DeviceProcessLost(RuntimeError):
    """The device process exited while a request was in flight (killed, out of memory, crashed)."""


# ----------------------------------------------------------------------------------------------- the child


def _engine(key: tuple[str, str, int, str]) -> Any:
    """The resident engine (loaded again if the memory budget evicted it since)."""
    name, base_model_dir, seed, chat_template = key
    return resident.engine_for(name, Path(base_model_dir), seed=seed, chat_template=chat_template)


def _serve(engine: Any, serve: resident.Serve | None) -> None:
    if serve is not None:
        resident.serve(engine, *serve)


def _load(key: tuple[str, str, int, str]) -> dict[str, Any]:
    return {"max_context": resident.context_tokens(_engine(key))}


def _generate_ids(key: tuple[str, str, int, str], serve: Any, contexts: list[list[int]], sampling: Any) -> list[Any]:
    engine = _engine(key)
    _serve(engine, serve)
    return list(engine.generate_ids(contexts, sampling))


def _generate(key: tuple[str, str, int, str], serve: Any, prompts: list[Any], sampling: Any) -> list[Any]:
    engine = _engine(key)
    _serve(engine, serve)
    return list(engine.generate(prompts, sampling))


def _rollout(key: tuple[str, str, int, str], prompts: list[Any], sampling: Any, serve: Any, judges: Any,
             keep: str | None) -> resident.Rollout:
    return resident._rollout(_engine(key), prompts, sampling, serve, judges, keep)


HANDLERS: dict[str, Callable[..., Any]] = {
    "ping": lambda: os.getpid(),
    "placement": resident.placement,
    "snapshot": resident.snapshot,
    "load": _load,
    "generate_ids": _generate_ids,
    "generate": _generate,
    "rollout": _rollout,
    "train": resident._train,
    "drop_trainer": resident.drop_trainer,
}


def _portable(exc: BaseException) -> BaseException:
    """The exception as the worker will raise it: itself when it pickles, else a RuntimeError with its type
    and message; either way with the child's traceback as a note."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        out = exc
    except Exception:
        out = RuntimeError(f"{type(exc).__name__}: {exc}")
    out.add_note("in the device process:\n" + "".join(traceback.format_exception(exc)).rstrip())
    return out


def serve_forever(conn: Connection) -> None:
    """Answer requests in arrival order until the socket closes: ``(id, ok, value, seconds, cpu)`` each, the
    request's wall and CPU seconds. With ``TEMPER_PROFILE`` (``workers/profiling.py``), each request is also
    a line of ``device-<pid>.jsonl`` there (a rollout's with its number of prompts)."""
    where = os.environ.get("TEMPER_PROFILE")
    profile = Path(where) / f"device-{os.getpid()}.jsonl" if where else None
    while True:
        try:
            rid, method, args = conn.recv()
        except (EOFError, OSError):
            return
        started, cpu = time.monotonic(), time.process_time()
        try:
            value, ok = HANDLERS[method](*args), True
        except Exception as exc:
            value, ok = _portable(exc), False
        reply = (rid, ok, value, time.monotonic() - started, time.process_time() - cpu)
        if profile is not None:
            ended = time.time()  # before the file is opened
            with profile.open("a") as out:
                # a rollout's prompts too: bench/pipeline_model.py takes device seconds a group from them; and
                # whether it failed, or a step queued ahead trained nothing (not a step's device time)
                items: dict[str, Any] = {"prompts": len(args[1])} if method == "rollout" else {}
                if method == "train" and ok:
                    items["trained"] = value is not None
                out.write(json.dumps({"method": method, "end": ended, "seconds": reply[3], "cpu": reply[4],
                                      "ok": ok, **items}) + "\n")
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except Exception as exc:  # a value that does not pickle: say so instead of dying
            conn.send((rid, False, _portable(exc), *reply[3:]))


def _watch_parent(parent: int) -> None:
    """Exit when the worker is gone, even while a long request runs (the socket's EOF is only seen between
    requests)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def main(argv: Sequence[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C: the worker stops first, then us
    resident.pin_device_cpus()
    os.set_inheritable(int(argv[0]), False)  # a process the child starts must not keep the worker's socket open
    conn = Connection(int(argv[0]))
    threading.Thread(target=_watch_parent, args=(int(argv[1]),), name="temper-watch-parent", daemon=True).start()
    resident.warm_up().join()  # before the first request, which needs them anyway
    serve_forever(conn)
    return 0


# ----------------------------------------------------------------------------------------------- the worker


@dataclass
class _Link:
    """One child and what waits for its answers."""

    proc: subprocess.Popen[bytes]
    sock: socket.socket
    conn: Connection
    """On a duplicate of ``sock``'s descriptor: ``sock.shutdown`` ends the connection even while the reader
    thread is blocked in ``conn.recv`` (closing a descriptor another thread reads does not)."""
    pending: dict[int, Future[Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards ``pending`` (never held while sending or receiving)."""


class DeviceClient:
    """The worker's end: starts the child, sends requests from any thread, hands each answer to the future
    that waits for it (a reader thread per child)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self._env = env
        self._send_lock = threading.Lock()
        self._link: _Link | None = None
        self._ids = itertools.count(1)
        self.starts = 0
        self.placement: Future[Any] | None = None
        """The child's placement (``resident.placement``), asked for as it starts."""
        self._engines: dict[tuple[str, str, int, str], RemoteEngine] = {}
        self._cpus = resident.device_cpus(env)
        """The device's CPUs, decided once, here: a child started again later is started by a thread that
        ``keep_off_device_cpus`` moved off them, and inherits that; deciding from it, it lost its core."""

    def start(self) -> None:
        with self._send_lock:
            self._ensure()

    def _ensure(self) -> _Link:
        link = self._link
        if link is not None and link.proc.poll() is None:
            return link
        ours, theirs = socket.socketpair()
        env = dict(self._env if self._env is not None else os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env["TEMPER_DEVICE_CPUS"] = ",".join(map(str, sorted(self._cpus))) if self._cpus else "none"
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "workers.policy.device_process", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        link = self._link = _Link(proc, ours, Connection(os.dup(ours.fileno())))
        self.starts += 1
        threading.Thread(target=self._read, args=(link,), name="temper-device-replies", daemon=True).start()
        log.info("device process %s started", proc.pid)
        self.placement = self._send(link, "placement", ())
        return link

    def _send(self, link: _Link, method: str, args: tuple[Any, ...]) -> Future[Any]:
        future: Future[Any] = Future()
        rid = next(self._ids)
        with link.lock:
            link.pending[rid] = future
        try:
            link.conn.send((rid, method, args))
        except Exception as exc:
            # Failed here unless the reader thread, seeing the child exit, failed it first (it takes every
            # pending future). Arguments that do not pickle fail this request alone; nothing was written.
            with link.lock:
                mine = link.pending.pop(rid, None) is not None
            if mine:
                future.set_exception(DeviceProcessLost(f"the device process is gone ({exc})")
                                     if isinstance(exc, OSError) else exc)
        return future

    def submit(self, method: str, *args: Any) -> Future[Any]:
        """Queue a request; its future holds ``(value, seconds, cpu seconds)`` or raises what the child raised."""
        with self._send_lock:  # one writer at a time: requests arrive whole and in this order
            return self._send(self._ensure(), method, args)

    def call(self, method: str, *args: Any) -> Any:
        return self.submit(method, *args).result()[0]

    def _read(self, link: _Link) -> None:
        try:
            while True:
                rid, ok, value, seconds, cpu = link.conn.recv()
                with link.lock:
                    future = link.pending.pop(rid, None)
                if future is None:
                    continue
                if ok:
                    future.set_result((value, seconds, cpu))
                else:
                    future.set_exception(value)
        except (EOFError, OSError):
            pass
        except Exception:  # an answer that does not unpickle here: nothing more can be read in step
            log.exception("reading the device process's answers failed; stopping it")
            link.proc.kill()
        code = link.proc.wait()
        with contextlib.suppress(OSError):
            link.conn.close()
            link.sock.close()
        with link.lock:
            lost, link.pending = link.pending, {}
        if lost:
            log.error("device process %s exited (%s) with %d request(s) in flight", link.proc.pid, code, len(lost))
        for future in lost.values():
            future.set_exception(DeviceProcessLost(f"the device process exited ({code}) during the request"))

    def close(self, timeout: float = 10.0) -> None:
        with self._send_lock:
            link, self._link = self._link, None
        if link is None:
            return
        with contextlib.suppress(OSError):
            link.sock.shutdown(socket.SHUT_RDWR)  # the child reads its end of file and exits
        try:
            link.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            link.proc.kill()
            link.proc.wait()

    @property
    def pid(self) -> int | None:
        return self._link.proc.pid if self._link is not None else None

    # -------------------------------------------------- what resident.use_remote needs (resident.Remote)

    def engine_for(self, name: str, base_model_dir: Path, seed: int = 0, chat_template: str = "") -> RemoteEngine:
        """One proxy per engine, loaded in the child on first use (a request that finds it evicted by the
        memory budget loads it again)."""
        key = (name, str(base_model_dir), seed, chat_template)
        engine = self._engines.get(key)
        if engine is None:
            info = self.call("load", key)
            engine = self._engines[key] = RemoteEngine(self, key, int(info["max_context"]))
        return engine

    def serve(self, engine: Any, run_id: int, version: int, version_dir: Path | None) -> None:
        engine.serving = (run_id, version, version_dir)

    def submit_rollout(self, engine: Any, prompts: list[Any], sampling: Any, serve: resident.Serve | None,
                       judges: list[resident.Judge | None] | None, keep: str | None) -> Future[Any]:
        return self.submit("rollout", engine.key, list(prompts), sampling, serve, judges, keep)

    def submit_train(self, run_id: int, base_model_dir: Path, config: Any, base: resident.Serve, step: int,
                     batch: list[tuple[list[Any], list[float | None]]] | None, kept: tuple[str, list[int]] | None,
                     out_dir: Path, spec_hash: str | None) -> Future[Any]:
        return self.submit("train", run_id, base_model_dir, config, base, step, batch, kept, out_dir, spec_hash)

    def drop_trainer(self, run_id: int) -> None:
        self.call("drop_trainer", run_id)

    def resolved_placement(self, wait: bool = True) -> Any:
        future = self.placement
        if future is None or (not wait and not future.done()):
            return None
        return future.result()[0]

    def snapshot(self) -> dict[str, Any]:
        return dict(self.call("snapshot"))


class RemoteEngine:
    """An engine in the device process (``workers.policy.engines.Engine``), for the callers that drive it
    turn by turn (multi-turn episodes, benches); the loop's single-turn work goes through
    ``resident.rollout``. The version to sample under (``resident.serve``) is kept per thread and sent with
    each request, so switching and sampling are one request and two task threads cannot mix theirs."""

    def __init__(self, client: DeviceClient, key: tuple[str, str, int, str], max_context: int) -> None:
        self.client, self.key, self.max_context = client, key, max_context
        self._serving = threading.local()
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()

    @property
    def serving(self) -> resident.Serve | None:
        return getattr(self._serving, "value", None)

    @serving.setter
    def serving(self, value: resident.Serve | None) -> None:
        self._serving.value = value

    @property
    def tokenizer(self) -> Any:
        """The base model's tokenizer, loaded in this process on first use (a multi-turn episode encodes
        each observation): the same files, with the same chat-template override, as the child's."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                from workers.policy.chat import apply_override

                self._tokenizer = AutoTokenizer.from_pretrained(self.key[1])
                apply_override(self._tokenizer, self.key[3])
            return self._tokenizer

    def generate_ids(self, contexts: list[list[int]], sampling: Any) -> list[Any]:
        return list(resident.wait(self.client.submit("generate_ids", self.key, self.serving, contexts, sampling)))

    def generate(self, prompts: Sequence[Any], sampling: Any) -> list[Any]:
        return list(resident.wait(self.client.submit("generate", self.key, self.serving, list(prompts), sampling)))

    def set_version(self, version_dir: str | Path | None) -> None:
        from workers.policy.engines import read_version_number

        self.serving = (-1, read_version_number(version_dir), Path(version_dir) if version_dir else None)


_CLIENT: DeviceClient | None = None


def enabled() -> bool:
    """Whether a GPU worker runs its device work in a device process (``TEMPER_DEVICE_PROCESS``, on unless
    ``0``), or in its own process."""
    return os.environ.get("TEMPER_DEVICE_PROCESS", "1") != "0"


def start() -> DeviceClient:
    """Start this process's device process and route ``resident``'s engines and trainers to it."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = DeviceClient()
        _CLIENT.start()
        resident.use_remote(_CLIENT)
    return _CLIENT


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
