"""The warm pool: zygote processes per runtime, handed out one execution at a time.

`SandboxPool` starts `size` zygotes per runtime (each a pre-started interpreter with modules
preloaded, keeping two isolated sandboxes pre-forked, see `sandboxes.zygote`). `run(spec)` takes a ready
sandbox from an idle zygote, runs the execution on it from this process (`sandboxes.runner`: inputs, job,
supervision, verdict) and hands it back to be reaped. A zygote found dead is replaced (a cold start);
one that dies mid-execution makes that execution a `sandbox_error`. Pools close with their owner process:
`close()`, the context manager, `atexit`, and — if the owner is killed — the zygotes notice that their
parent is gone and exit, killing any execution in flight. After `os.fork()` (a Celery prefork child),
the child never uses its parent's zygotes: it starts its own on first use.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any

from sandboxes._linux import CgroupSet
from sandboxes.api import SandboxResult, SandboxSpec
from sandboxes.protocol import Standby, readable, recv_packet, send_packet
from sandboxes.runner import Runner, error_result
from sandboxes.zygote import SANDBOX_ENV

log = logging.getLogger("sandboxes")

RUNTIMES = ("python",)
START_TIMEOUT = 30.0
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BOOTSTRAP = (
    "import sys; sys.path.insert(0, {path!r}); "
    "from sandboxes.zygote import main; main()"
)


class _Zygote:
    """The owner's handle on one zygote process and the standbys it hands out."""

    def __init__(self, runtime: str, forced_tier: str | None) -> None:
        self.runtime = runtime
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOTSTRAP.format(path=_PACKAGE_PARENT), str(os.getpid()),
                 str(child_sock.fileno()), forced_tier or ""],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=dict(SANDBOX_ENV),  # the sandbox's /proc/*/environ shows this, never the worker's
                pass_fds=(child_sock.fileno(),),
                close_fds=True,
                cwd="/",
            )
        finally:
            child_sock.close()
        self.sock = parent_sock
        self.owner_pid = os.getpid()
        self.pending: deque[Standby] = deque()
        self.exits: dict[int, tuple[int, float, int]] = {}  # ident -> wait status, CPU, max RSS
        self.active: set[int] = set()  # the idents of the standbys in use (an execution's, or sessions')
        parent_sock.settimeout(START_TIMEOUT)
        try:
            hello, _ = recv_packet(parent_sock)
        except OSError as exc:
            self.kill()
            raise RuntimeError(f"sandbox zygote did not start: {exc!r}") from exc
        if not hello or not hello.get("ready"):
            self.kill()
            raise RuntimeError(f"sandbox zygote failed to start: {hello and hello.get('error')}")
        self.runner = Runner(hello)
        self.tier: str = hello["tier"]

    def _receive(self) -> dict[str, Any]:
        """The next message from the zygote; standbys arriving meanwhile are queued."""
        while True:
            message, fds = recv_packet(self.sock)
            if message is None:
                for fd in fds:
                    os.close(fd)
                raise EOFError("the sandbox zygote exited")
            if "exited" in message:
                if message["exited"] in self.active:
                    self.exits[message["exited"]] = (message["status"], message["cpu"], message["maxrss"])
                return {}
            if "standby" not in message:
                return dict(message)
            meta = message["standby"]
            if len(fds) != 6:
                for fd in fds:
                    os.close(fd)
                raise RuntimeError(f"the sandbox zygote sent {len(fds)} fds with a standby, expected 6")
            pidfd, go_w, stdin_fd, out_r, err_r, rep_r = fds
            cgroup = None if meta["cgroup"] is None else CgroupSet.from_wire(meta["cgroup"])
            self.pending.append(Standby(meta["pid"], pidfd, meta["slot"], cgroup, go_w, stdin_fd,
                                        out_r, err_r, rep_r, meta["ident"]))
            return {}

    def _send(self, message: dict[str, Any]) -> None:
        """Send without ever blocking on a full socket while the zygote blocks on ours: each side's sends
        fill the other's receive queue (a hundred sessions closing at once queue a hundred ``exited``
        messages), so when the socket is full the owner reads what the zygote sent, then tries again."""
        deadline = time.monotonic() + START_TIMEOUT
        timeout = self.sock.gettimeout()
        try:
            while True:
                self.sock.settimeout(0.0)  # with a timeout, CPython would wait for room first
                try:
                    send_packet(self.sock, message)
                    return
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the sandbox zygote read nothing for {START_TIMEOUT} s") from None
                self.sock.settimeout(START_TIMEOUT)
                while readable(self.sock.fileno(), 0.01):
                    self._receive()
        finally:
            self.sock.settimeout(timeout)

    def _take(self) -> Standby:
        self.sock.settimeout(START_TIMEOUT)
        while True:
            while not self.pending:
                self._receive()
            standby = self.pending.popleft()
            self._send({"took": standby.ident})
            if not readable(standby.pidfd, 0):
                return standby
            self._release(standby)  # it died while waiting (should not happen): never use it

    def _release(self, standby: Standby) -> None:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(standby.pidfd, signal.SIGKILL)  # no-op when it already ended
        standby.close_fds()
        self._send({"release": standby.ident})

    def _remount(self, ident: int, size: int) -> None:
        self._send({"remount": ident, "size": size})
        while self._receive().get("remounted") != ident:
            pass

    def _exit_status(self, ident: int, timeout: float) -> tuple[int, float, int] | None:
        """How the sandbox `ident` ended, as its parent (the zygote) saw it."""
        deadline = time.monotonic() + timeout
        while ident not in self.exits:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                self._receive()
            except TimeoutError:
                return None
        return self.exits.pop(ident)

    def execute(self, spec: SandboxSpec) -> tuple[SandboxResult, float | None]:
        standby = self._take()
        self.active.add(standby.ident)
        try:
            return self.runner.execute(standby, spec, self._remount, self._exit_status)
        finally:
            self.active.discard(standby.ident)
            self.exits.pop(standby.ident, None)
            self._release(standby)

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        if self.owner_pid != os.getpid():  # a forked copy of the handle: the zygote is not ours
            self._close_fds()
            return
        with contextlib.suppress(OSError):
            send_packet(self.sock, {"quit": True})
        self._close_fds()
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.kill()

    def _close_fds(self) -> None:
        while self.pending:
            self.pending.popleft().close_fds()
        with contextlib.suppress(OSError):
            self.sock.close()

    def kill(self) -> None:
        self._close_fds()
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired, ChildProcessError):
            self.process.wait(timeout=5.0)


_live_pools: weakref.WeakSet[SandboxPool] = weakref.WeakSet()


class SandboxPool:
    """`size` warm zygotes per runtime; `run(spec)` is thread-safe and blocks until the verdict."""

    def __init__(self, size: int = 2, runtimes: Iterable[str] = RUNTIMES, *, _force_tier: str | None = None):
        runtimes = tuple(runtimes)
        unknown = [r for r in runtimes if r not in RUNTIMES]
        if unknown:
            raise ValueError(f"unknown sandbox runtime(s) {unknown}; available: {list(RUNTIMES)}")
        if size < 1:
            raise ValueError("SandboxPool size must be >= 1")
        self.size = size
        self.runtimes = runtimes
        self._forced_tier = _force_tier
        self._lock = threading.Lock()
        self._idle: dict[str, queue.LifoQueue[_Zygote | None]] = {}
        self._all: list[_Zygote] = []
        self._closed = False
        self._owner_pid = os.getpid()
        self._stats = {"executions": 0, "warm_hits": 0, "cold_starts": 0, "failures": 0}
        self._latencies: deque[float] = deque(maxlen=2000)
        self.tier: str | None = None
        self.zygote_pids: list[int] = []  # every zygote this pool started (sandbox uid = UID_BASE + pid)
        self._fill()
        _live_pools.add(self)

    # ------------------------------------------------------------ lifecycle

    def _fill(self) -> None:
        self._idle = {}
        for runtime in self.runtimes:
            slots: queue.LifoQueue[_Zygote | None] = queue.LifoQueue()
            for _ in range(self.size):
                slots.put(None)  # a slot without a zygote yet: started on first use
            self._idle[runtime] = slots
        # Pre-start one zygote per runtime now so that the first execution is warm and the tier is known.
        for runtime in self.runtimes:
            self._idle[runtime].get()
            zygote = self._start(runtime)
            self._idle[runtime].put(zygote)
        log.info("sandbox pool ready: size=%d runtimes=%s tier=%s", self.size, ",".join(self.runtimes), self.tier)

    def _start(self, runtime: str) -> _Zygote:
        zygote = _Zygote(runtime, self._forced_tier)
        with self._lock:
            self._all.append(zygote)
            self.zygote_pids.append(zygote.process.pid)
            self._stats["cold_starts"] += 1
            self.tier = zygote.tier
        return zygote

    def _check_owner(self) -> None:
        """After a fork, drop the parent's zygotes (never used from here) and start our own."""
        if self._owner_pid == os.getpid():
            return
        with self._lock:
            if self._owner_pid == os.getpid():
                return
            for zygote in self._all:
                zygote._close_fds()
            self._all = []
            self._owner_pid = os.getpid()
            self._stats = {"executions": 0, "warm_hits": 0, "cold_starts": 0, "failures": 0}
            self._latencies.clear()
        self._fill()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            zygotes, self._all = self._all, []
        for zygote in zygotes:
            zygote.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # ------------------------------------------------------------ executions

    def run(self, spec: SandboxSpec) -> SandboxResult:
        if self._closed:
            raise RuntimeError("this SandboxPool is closed")
        self._check_owner()
        if spec.runtime not in self._idle:
            return error_result(self.tier or "unknown", f"runtime {spec.runtime!r} is not in this pool "
                                 f"(runtimes: {list(self.runtimes)})")
        slots = self._idle[spec.runtime]
        zygote = slots.get()
        t0 = time.monotonic()
        warm = zygote is not None and zygote.alive()
        try:
            if not warm:
                if zygote is not None:
                    zygote.kill()
                zygote = self._start(spec.runtime)
            assert zygote is not None
            result, start_t = zygote.execute(spec)
        except Exception as exc:
            if zygote is not None:
                zygote.kill()
                with self._lock:
                    if zygote in self._all:
                        self._all.remove(zygote)
            slots.put(None)
            with self._lock:
                self._stats["failures"] += 1
                self._stats["executions"] += 1
            return error_result(self.tier or "unknown", f"sandbox infrastructure failure: {exc!r}")
        slots.put(zygote)
        with self._lock:
            self._stats["executions"] += 1
            if warm:
                self._stats["warm_hits"] += 1
            if result.status == "sandbox_error":
                self._stats["failures"] += 1
            if warm and isinstance(start_t, float):
                self._latencies.append(max(0.0, start_t - t0))
        return result

    def stats(self) -> dict[str, Any]:
        with self._lock:
            latencies = sorted(self._latencies)
            alive = sum(1 for z in self._all if z.alive())
            out: dict[str, Any] = {
                "size": self.size,
                "runtimes": list(self.runtimes),
                "alive": alive,
                "tier": self.tier,
                **self._stats,
            }
        out["start_latency_p50_ms"] = _percentile(latencies, 0.50) * 1e3 if latencies else None
        out["start_latency_p95_ms"] = _percentile(latencies, 0.95) * 1e3 if latencies else None
        return out


def _percentile(sorted_values: list[float], q: float) -> float:
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[min(98, max(0, int(q * 100) - 1))]


# ---------------------------------------------------------------- the process-wide default pool

_default_pool: SandboxPool | None = None
_default_lock = threading.Lock()


def default_pool() -> SandboxPool:
    global _default_pool
    with _default_lock:
        if _default_pool is None or _default_pool._closed:
            size = int(os.environ.get("TEMPER_SANDBOX_POOL_SIZE", "1"))
            _default_pool = SandboxPool(size=size)
        return _default_pool


def run(spec: SandboxSpec) -> SandboxResult:
    """Run one execution in the process-wide default pool (created on first use)."""
    return default_pool().run(spec)


def _close_all() -> None:
    for pool in list(_live_pools):
        with contextlib.suppress(Exception):
            pool.close()


def _after_fork_in_child() -> None:
    # The child must neither use nor shut down its parent's zygotes; close our copies of the sockets.
    global _default_pool
    _default_pool = None
    for pool in list(_live_pools):
        for zygote in pool._all:
            zygote._close_fds()


atexit.register(_close_all)
os.register_at_fork(after_in_child=_after_fork_in_child)
