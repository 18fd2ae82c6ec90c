"""The warm pool: zygote processes per runtime, handed out one execution at a time.

`SandboxPool` keeps up to `size` zygotes per runtime (each a pre-started interpreter with modules
preloaded, keeping two isolated sandboxes pre-forked, see `sandboxes.zygote`). The runtimes it is created
with start now; any other defined runtime (`sandboxes.runtimes`) on its first execution — its image built
first if this machine has none — and at most `max_runtimes` runtimes keep zygotes (the least recently
used one's are closed). `run(spec)` takes a ready sandbox from an idle zygote of `spec.runtime`, runs the
execution on it from this process (`sandboxes.runner`: inputs, job, supervision, verdict) and hands it
back to be reaped. A zygote found dead is replaced (a cold start). An infrastructure failure — a zygote
that cannot start or dies mid-execution, an image that cannot be built or is broken — is retried on a
fresh zygote up to `INFRA_RETRIES` times (a broken image is moved aside and rebuilt first), then returned as
a `sandbox_error` saying why: never as the code's failure. Pools close with their owner process:
`close()`, the context manager, `atexit`, and — if the owner is killed — the zygotes notice that their
parent is gone and exit, killing any execution in flight. After `os.fork()` (a Celery prefork child),
the child never uses its parent's zygotes: it starts its own on first use.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
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

from sandboxes import runtimes as runtime_defs
from sandboxes._linux import CgroupSet
from sandboxes.api import SandboxResult, SandboxSpec
from sandboxes.protocol import Standby, readable, recv_packet, send_packet
from sandboxes.runner import Runner, error_result
from sandboxes.zygote import SANDBOX_ENV

log = logging.getLogger("sandboxes")

RUNTIMES = (runtime_defs.DEFAULT_NAME,)
"""The runtimes a pool starts with (others start on first use)."""
INFRA_RETRIES = 2
"""Fresh zygotes tried after an infrastructure failure before the execution is a `sandbox_error`."""
MAX_RUNTIMES = int(os.environ.get("TEMPER_SANDBOX_MAX_RUNTIMES", "4"))
"""Runtimes that keep warm zygotes in one pool at a time."""
START_TIMEOUT = 30.0
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BOOTSTRAP = (
    "import sys; sys.path.insert(0, {path!r}); "
    "from sandboxes.zygote import main; main()"
)


@dataclasses.dataclass(frozen=True)
class Launch:
    """How a runtime's zygotes start: which interpreter, what they preload, what they may import."""

    executable: str
    preload: tuple[str, ...] = ()
    stdlib_only: bool = False
    image: runtime_defs.Image | None = None


@dataclasses.dataclass
class BuildFacts:
    """What resolving a runtime's image cost: a build (and its seconds) or a cache hit."""

    built: bool = False
    seconds: float = 0.0


def launch_for(runtime: str, progress: Any = None) -> tuple[Launch, BuildFacts]:
    """The launch of ``runtime``'s zygotes, building its image first when this machine has none.

    Raises ``runtimes.BuildError`` or ``runtimes.RuntimeDefinitionError`` (unknown runtime) with the reason."""
    definition = runtime_defs.get(runtime)
    if definition.is_default:
        return Launch(sys.executable, stdlib_only=True), BuildFacts()
    started = time.monotonic()
    image, built = runtime_defs.ensure_image(definition, progress=progress or log.info)
    return Launch(image.python, definition.preload, image=image), BuildFacts(built, time.monotonic() - started)


SANDBOX_NICE = 10
"""Sandboxed code runs at this nice at least, below Temper's own processes."""


def _below_temper(pid: int) -> None:
    """Put a new zygote (and so every sandbox it forks) below Temper's own processes — nice 10 at least — and
    let it run on any CPU of the machine. *Why:* a zygote inherits its owner's scheduling: the sandbox workers
    already run at nice 10 on every CPU, but the GPU worker, whose multi-turn episodes open sessions, runs at
    nice 0 and is kept off its device process's CPU (``manage.py up``), where its sessions crowded the
    worker's own bookkeeping on the other core (``bench/pipeline.py --episodes``)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, max(SANDBOX_NICE, os.getpriority(os.PRIO_PROCESS, pid)))
    with contextlib.suppress(OSError):
        os.sched_setaffinity(pid, range(os.cpu_count() or 1))


class _Zygote:
    """The owner's handle on one zygote process and the standbys it hands out."""

    def __init__(self, runtime: str, forced_tier: str | None, launch: Launch | None = None) -> None:
        self.runtime = runtime
        self.build_seconds = 0.0  # the image build its start waited for
        launch = launch or Launch(sys.executable, stdlib_only=runtime == runtime_defs.DEFAULT_NAME)
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [launch.executable, "-I", "-c", _BOOTSTRAP.format(path=_PACKAGE_PARENT), str(os.getpid()),
                 str(child_sock.fileno()), forced_tier or "", ",".join(launch.preload),
                 "1" if launch.stdlib_only else ""],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=dict(SANDBOX_ENV),  # the sandbox's /proc/*/environ shows this, never the worker's
                pass_fds=(child_sock.fileno(),),
                close_fds=True,
                cwd="/",
            )
        finally:
            child_sock.close()
        _below_temper(self.process.pid)
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

_COUNTERS = ("executions", "warm_hits", "cold_starts", "failures", "retries", "image_builds", "image_cache_hits",
             "build_seconds")


def _counters() -> dict[str, float]:
    return dict.fromkeys(_COUNTERS, 0)


class SandboxPool:
    """Up to `size` warm zygotes per runtime; `run(spec)` is thread-safe and blocks until the verdict.

    `runtimes` start now (the default runtime's first zygote, and the tier, are known before the first
    execution); any other defined runtime starts on first use, and at most `max_runtimes` keep zygotes."""

    def __init__(self, size: int = 2, runtimes: Iterable[str] = RUNTIMES, *, max_runtimes: int = MAX_RUNTIMES,
                 _force_tier: str | None = None):
        runtimes = tuple(runtimes)
        for runtime in runtimes:
            runtime_defs.get(runtime)  # ValueError naming the defined ones
        if size < 1:
            raise ValueError("SandboxPool size must be >= 1")
        self.size = size
        self.runtimes = runtimes
        self.max_runtimes = max(1, max_runtimes, len(runtimes))
        self._forced_tier = _force_tier
        self._lock = threading.Lock()
        self._idle: dict[str, queue.LifoQueue[_Zygote | None]] = {}
        self._recent: dict[str, None] = {}  # runtimes with zygotes, least recently used first
        self._launches: dict[str, Launch] = {}
        self._all: list[_Zygote] = []
        self._closed = False
        self._owner_pid = os.getpid()
        self._stats = _counters()
        self._by_runtime: dict[str, dict[str, float]] = {}
        self._latencies: deque[float] = deque(maxlen=2000)
        self._latencies_by_runtime: dict[str, deque[float]] = {}
        self.tier: str | None = None
        self.zygote_pids: list[int] = []  # every zygote this pool started (sandbox uid = UID_BASE + pid)
        self._fill()
        _live_pools.add(self)

    # ------------------------------------------------------------ lifecycle

    def _fill(self) -> None:
        self._idle, self._recent = {}, {}
        # Pre-start one zygote per runtime now so that the first execution is warm and the tier is known.
        for runtime in self.runtimes:
            slots = self._slots(runtime)
            slots.get()
            zygote = self._start(runtime)
            slots.put(zygote)
        log.info("sandbox pool ready: size=%d runtimes=%s tier=%s", self.size, ",".join(self.runtimes), self.tier)

    def _slots(self, runtime: str) -> queue.LifoQueue[_Zygote | None]:
        """The runtime's zygote slots (made on first use; the least recently used runtime beyond
        `max_runtimes` has its idle zygotes closed)."""
        with self._lock:
            slots = self._idle.get(runtime)
            if slots is None:
                runtime_defs.get(runtime)  # unknown: ValueError before anything is made
                slots = queue.LifoQueue()
                for _ in range(self.size):
                    slots.put(None)  # a slot without a zygote yet: started on first use
                self._idle[runtime] = slots
                self._by_runtime.setdefault(runtime, _counters())
            self._recent.pop(runtime, None)
            self._recent[runtime] = None
            evicted = [r for r in list(self._recent)[: max(0, len(self._recent) - self.max_runtimes)]]
            evicted_slots = []
            for r in evicted:
                self._recent.pop(r, None)
                evicted_slots.append(self._idle.pop(r))
        for old in evicted_slots:
            while True:
                try:
                    zygote = old.get_nowait()
                except queue.Empty:
                    break
                if zygote is not None:
                    self._retire(zygote)
        return slots

    def _launch(self, runtime: str) -> tuple[Launch, float]:
        """How the runtime's zygotes start, and the seconds spent building its image now (0: found built);
        the image is resolved per cold start."""
        with self._lock:
            launch = self._launches.get(runtime)
        facts = BuildFacts()
        if launch is None or (launch.image is not None and not os.path.exists(launch.image.python)):
            launch, facts = launch_for(runtime)
            with self._lock:
                self._launches[runtime] = launch
        if launch.image is not None:
            with self._lock:
                for counters in (self._stats, self._by_runtime[runtime]):
                    counters["image_builds" if facts.built else "image_cache_hits"] += 1
                    counters["build_seconds"] += facts.seconds if facts.built else 0.0
        return launch, facts.seconds if facts.built else 0.0

    def _start(self, runtime: str) -> _Zygote:
        launch, build_seconds = self._launch(runtime)
        zygote = _Zygote(runtime, self._forced_tier, launch)
        zygote.build_seconds = build_seconds
        with self._lock:
            self._all.append(zygote)
            self.zygote_pids.append(zygote.process.pid)
            self._stats["cold_starts"] += 1
            self._by_runtime[runtime]["cold_starts"] += 1
            self.tier = zygote.tier
        return zygote

    def _retire(self, zygote: _Zygote) -> None:
        with self._lock:
            if zygote in self._all:
                self._all.remove(zygote)
        zygote.close()

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
            self._stats = _counters()
            self._by_runtime = {}
            self._latencies.clear()
            self._latencies_by_runtime = {}
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
        """Run one execution in a warm sandbox of ``spec.runtime``; an infrastructure failure is retried on
        a fresh zygote (`INFRA_RETRIES`), then a `sandbox_error` saying why."""
        if self._closed:
            raise RuntimeError("this SandboxPool is closed")
        self._check_owner()
        try:
            slots = self._slots(spec.runtime)
        except ValueError as exc:
            return error_result(self.tier or "unknown", str(exc))
        failures: list[str] = []
        for attempt in range(1 + INFRA_RETRIES):
            if attempt:
                with self._lock:
                    self._stats["retries"] += 1
                    self._by_runtime[spec.runtime]["retries"] += 1
                log.warning("sandbox runtime %s: retrying on a fresh zygote after %s", spec.runtime, failures[-1])
            result = self._attempt(spec, slots, failures)
            if result is not None:
                return dataclasses.replace(result, runtime=spec.runtime, attempts=attempt + 1)
        tried = "; ".join(dict.fromkeys(failures))
        return dataclasses.replace(
            error_result(self.tier or "unknown", f"sandbox infrastructure failure on runtime {spec.runtime!r} "
                         f"after {len(failures)} attempts: {tried}"[:1000]),
            runtime=spec.runtime, attempts=len(failures))

    def _attempt(self, spec: SandboxSpec, slots: queue.LifoQueue[_Zygote | None], failures: list[str]
                 ) -> SandboxResult | None:
        """One try: the result, or None after an infrastructure failure (recorded in ``failures``)."""
        runtime = spec.runtime
        zygote = slots.get()
        t0 = time.monotonic()
        warm = zygote is not None and zygote.alive()
        try:
            if not warm:
                if zygote is not None:
                    zygote.kill()
                zygote = None
                zygote = self._start(runtime)
            assert zygote is not None
            result, start_t = zygote.execute(spec)
            result = dataclasses.replace(result, warm=warm, build_seconds=0.0 if warm else zygote.build_seconds)
        except runtime_defs.BuildError as exc:  # the build failed (and said why): retrying would fail again
            slots.put(None)
            self._count_failure(runtime)
            return error_result(self.tier or "unknown", str(exc)[:1000])
        except Exception as exc:
            if zygote is not None:
                zygote.kill()
                with self._lock:
                    if zygote in self._all:
                        self._all.remove(zygote)
            elif not warm:
                self._check_image(runtime, exc)
            slots.put(None)
            self._count_failure(runtime)
            failures.append(f"{type(exc).__name__}: {exc}")
            return None
        assert zygote is not None
        with self._lock:
            current = self._idle.get(runtime) is slots
        if current:
            slots.put(zygote)
        else:  # the runtime was evicted while this ran
            slots.put(None)
            self._retire(zygote)
        with self._lock:
            for counters in (self._stats, self._by_runtime[runtime]):
                counters["executions"] += 1
                if warm:
                    counters["warm_hits"] += 1
                if result.status == "sandbox_error":
                    counters["failures"] += 1
            if warm and isinstance(start_t, float):
                self._latencies.append(max(0.0, start_t - t0))
                self._latencies_by_runtime.setdefault(runtime, deque(maxlen=2000)).append(max(0.0, start_t - t0))
        return result

    def _count_failure(self, runtime: str) -> None:
        with self._lock:
            for counters in (self._stats, self._by_runtime[runtime]):
                counters["failures"] += 1
                counters["executions"] += 1

    def _check_image(self, runtime: str, exc: Exception) -> None:
        """A zygote could not start: when its image is broken (its interpreter does not run, or its preload
        does not import), move the image aside so the next try rebuilds it."""
        with self._lock:
            launch = self._launches.get(runtime)
        if launch is None or launch.image is None:
            return
        probe = "; ".join(f"import {m}" for m in launch.preload) or "pass"
        try:
            ok = subprocess.run([launch.image.python, "-I", "-c", probe], capture_output=True, timeout=60,
                                env=dict(SANDBOX_ENV)).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if not ok:
            log.error("sandbox runtime %s: image %s is broken (%s); moved aside to be rebuilt", runtime,
                      launch.image.key, exc)
            runtime_defs.quarantine(launch.image, f"{type(exc).__name__}: {exc}")
            with self._lock:
                self._launches.pop(runtime, None)

    def stats(self) -> dict[str, Any]:
        """Counters of the whole pool, and per runtime (``runtimes_stats``): executions, warm hits and
        cold starts, failures and retries, image builds (and their seconds), image cache hits, the reuse
        rate (executions per build; an image found built counts as one build made elsewhere) and the
        warm start latency."""
        with self._lock:
            latencies = sorted(self._latencies)
            alive = sum(1 for z in self._all if z.alive())
            out: dict[str, Any] = {
                "size": self.size,
                "runtimes": list(self.runtimes),
                "alive": alive,
                "tier": self.tier,
                **{k: (round(v, 3) if k == "build_seconds" else int(v)) for k, v in self._stats.items()},
            }
            per = {name: (dict(c), sorted(self._latencies_by_runtime.get(name, ()))) for name, c in
                   self._by_runtime.items()}
        out["start_latency_p50_ms"] = _percentile(latencies, 0.50) * 1e3 if latencies else None
        out["start_latency_p95_ms"] = _percentile(latencies, 0.95) * 1e3 if latencies else None
        out["runtimes_stats"] = {}
        for name, (c, lat) in per.items():
            images = c["image_builds"] + (1 if c["image_cache_hits"] and not c["image_builds"] else 0)
            out["runtimes_stats"][name] = {
                **{k: (round(v, 3) if k == "build_seconds" else int(v)) for k, v in c.items()},
                "reuse_rate": round(c["executions"] / images, 1) if images else None,
                "start_latency_p50_ms": _percentile(lat, 0.50) * 1e3 if lat else None,
            }
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
