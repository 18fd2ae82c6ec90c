"""Sessions: one sandbox kept for a whole episode, its interpreter's variables and its work directory's files
living across the calls (cells) of that episode, and nothing of it outliving it.

    from sandboxes.session import SessionPool, SessionSpec
    with SessionPool() as pool, pool.open(SessionSpec(files={"data.csv": ...})) as session:
        session.run("x = 6 * 7").status          # "ok"
        session.run("print(x)").stdout            # "42\\n"
        session.run("while True: pass").status   # "timeout": interrupted; the session goes on
        artifacts = session.close()

Design (measured against the alternatives in ``bench/sessions.py``): a long-lived sandbox process per
episode, forked from the same warm zygote as one-shot executions, with the same isolation (its own PID,
mount, network, IPC and UTS namespaces, read-only root, private tmpfs, unmapped uid, cgroup limits, the
harness's audit hook). The harness runs in *session* mode: after the optional setup code it reads cells from
its go pipe, executes each in the one namespace, and reports each over the authenticated channel (HMAC per
frame) after flushing its output, so the owner knows exactly where a cell's output ends. Replaying every
earlier cell in a fresh process (the naive way to keep state) costs a start per call and grows with the
episode; a fork-checkpoint per call costs a fork per call; a process per episode costs one fork per episode.

Limits: per cell, wall time (the owner interrupts the cell with SIGINT: ``timeout``, and the session goes
on; a cell that will not be interrupted is killed with its whole session) and output bytes; per episode, CPU
time (RLIMIT_CPU), memory and processes (the cgroup), disk (the tmpfs) and a deadline (``deadline_seconds``,
after which the session is killed).

No orphan, ever: a session is PID 1 of its own namespace, the zygote's child with PR_SET_PDEATHSIG; the
zygote dies with its owner (socket EOF, reparenting), so killing the worker kills the session. Besides, every
session is *leased* before anything waits on it: a file in ``LEASE_DIR`` with the owner's pid, the
session's pid and start time, and its deadline; ``sweep()`` (run by every new pool, and by its watchdog
thread) kills any leased session whose owner is gone or whose deadline passed.

Reset by construction: a session is never reused; the next episode gets a new process, tmpfs and cgroup.
Artifacts declared in the spec are collected when it closes (also after a timeout or a kill).
"""

from __future__ import annotations

import contextlib
import glob
import json
import marshal
import os
import secrets
import select
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sandboxes.api import Artifact, Limits, SandboxSpec
from sandboxes.harness import FRAME_HEADER, MAX_FRAME_BYTES, ReportTampered, sign
from sandboxes.pool import _Zygote, launch_for
from sandboxes.protocol import JOB_LENGTH, Standby, readable
from sandboxes.runner import _drain, collect_artifacts

LEASE_DIR = Path(os.environ.get("TEMPER_SESSION_LEASES", "/tmp/temper-session-leases"))
INTERRUPT_GRACE_S = 1.0
"""After a cell's time limit, how long the interrupted cell has to report before the session is killed."""

CellStatus = Literal["ok", "error", "timeout", "output_limit", "session_error"]


@dataclass(frozen=True)
class SessionLimits:
    cell_wall_seconds: float = 5.0
    """Wall time of one cell; then it is interrupted (``timeout``) and the session goes on."""
    cpu_seconds: float = 60.0
    """CPU time of the whole session (RLIMIT_CPU of its init; then the kernel kills it)."""
    deadline_seconds: float = 120.0
    """The episode's deadline: the session is killed this long after it opened, whatever it is doing."""
    memory_bytes: int = 512 << 20
    max_processes: int = 32
    max_output_bytes: int = 64 << 10
    """Output kept per cell (stdout and stderr each); a cell printing over 16 times this kills the session."""
    disk_bytes: int = 64 << 20
    max_file_bytes: int = 16 << 20
    max_open_files: int = 64


@dataclass(frozen=True)
class SessionSpec:
    setup: str = ""
    """Code run first (the environment's own: tool definitions, data loading), in the same namespace."""
    files: Mapping[str, str | bytes] = field(default_factory=dict)
    """Read-only inputs in the work directory."""
    writable_files: Mapping[str, str | bytes] = field(default_factory=dict)
    artifacts: Sequence[str] = ()
    """Glob patterns (relative to the work directory) collected when the session closes."""
    limits: SessionLimits = field(default_factory=SessionLimits)
    runtime: str = "python"
    """The runtime whose warm interpreter runs the session (``sandboxes.runtimes``; its image read-only)."""


@dataclass(frozen=True)
class CellResult:
    status: CellStatus
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    """The exception the cell raised (``Type: message``), or why the session failed."""
    wall_seconds: float = 0.0
    cpu_seconds: float | None = None
    truncated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "stdout": self.stdout, "stderr": self.stderr, "error": self.error,
                "wall_seconds": round(self.wall_seconds, 6), "cpu_seconds": self.cpu_seconds,
                "truncated": self.truncated}


class FrameReader:
    """The authenticated report stream, verified frame by frame as it arrives (``harness.decode_frames``
    does the same for a complete stream)."""

    def __init__(self, key: bytes) -> None:
        self.key, self.seq, self.buffer = key, 0, bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self.buffer += data
        out = []
        while len(self.buffer) >= FRAME_HEADER.size:
            length, mac = FRAME_HEADER.unpack_from(self.buffer, 0)
            if length > MAX_FRAME_BYTES:
                raise ReportTampered("bad frame length")
            if len(self.buffer) < FRAME_HEADER.size + length:
                break
            payload = bytes(self.buffer[FRAME_HEADER.size:FRAME_HEADER.size + length])
            if mac != sign(self.key, self.seq, payload):
                raise ReportTampered(f"bad MAC on frame {self.seq}")
            del self.buffer[:FRAME_HEADER.size + length]
            self.seq += 1
            message = json.loads(payload)
            if not isinstance(message, dict):
                raise ReportTampered("frame is not an object")
            out.append(message)
        return out


# ---------------------------------------------------------------- leases


def _start_time(pid: int) -> str | None:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def write_lease(session_pid: int, deadline: float) -> Path:
    LEASE_DIR.mkdir(parents=True, exist_ok=True)
    path = LEASE_DIR / f"{os.getpid()}-{session_pid}.json"
    path.write_text(json.dumps({"owner": os.getpid(), "owner_start": _start_time(os.getpid()), "pid": session_pid,
                                "start": _start_time(session_pid), "deadline": deadline}))
    return path


def sweep(now: float | None = None) -> list[int]:
    """Kill every leased session whose owner is gone or whose deadline passed; the pids killed."""
    now = time.time() if now is None else now
    killed = []
    for path in LEASE_DIR.glob("*.json") if LEASE_DIR.exists() else []:
        try:
            lease = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        pid = int(lease["pid"])
        same = _alive(pid) and _start_time(pid) == lease.get("start")  # never a recycled pid
        owner_gone = not (_alive(int(lease["owner"])) and _start_time(int(lease["owner"])) == lease.get("owner_start"))
        if same and (owner_gone or now > float(lease["deadline"]) + INTERRUPT_GRACE_S):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        if not same or owner_gone or now > float(lease["deadline"]) + INTERRUPT_GRACE_S:
            path.unlink(missing_ok=True)
    return killed


# ---------------------------------------------------------------- a session


class Session:
    """One episode's sandbox. Not thread-safe: one caller at a time (the episode's)."""

    def __init__(self, pool: SessionPool, standby: Standby, spec: SessionSpec, zygote: _Zygote) -> None:
        self.pool, self.standby, self.spec, self.zygote = pool, standby, spec, zygote
        self.limits = spec.limits
        self.opened = time.monotonic()
        self.deadline = self.opened + self.limits.deadline_seconds
        self.lease = write_lease(standby.pid, time.time() + self.limits.deadline_seconds)
        self.key = secrets.token_bytes(32)
        self.reader = FrameReader(self.key)
        self.dead: str | None = None
        self.closed = False
        self.artifacts: list[Artifact] = []
        self._cpu_mark = standby.cgroup.cpu_seconds() if standby.cgroup is not None else None
        for fd in (standby.out_r, standby.err_r, standby.rep_r):
            os.set_blocking(fd, False)
        self._start()

    @property
    def pid(self) -> int:
        return self.standby.pid

    # ------------------------------------------------------------ lifecycle

    def _start(self) -> None:
        runner, standby, lim = self.zygote.runner, self.standby, self.limits
        setup = SandboxSpec(code=self.spec.setup, files=self.spec.files, writable_files=self.spec.writable_files,
                            limits=Limits(cpu_seconds=lim.cpu_seconds, wall_seconds=lim.deadline_seconds,
                                          memory_bytes=lim.memory_bytes, max_processes=lim.max_processes,
                                          max_file_bytes=lim.max_file_bytes, max_open_files=lim.max_open_files,
                                          max_output_bytes=lim.max_output_bytes, disk_bytes=lim.disk_bytes))
        runner._prepare(standby, setup, lambda ident, size: self.pool._remount(self.zygote, ident, size))
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, standby.pid, 0)
        sandbox_root = "/tmp" if runner.namespaces else standby.slot
        job: tuple[Any, ...] = (setup.code, os.path.join(sandbox_root, "main.py"), [], None, self.key,
               (lim.cpu_seconds, lim.max_file_bytes, lim.max_open_files, lim.max_processes, lim.memory_bytes), True)
        data = marshal.dumps(job)
        try:
            _write_all(standby.go_w, JOB_LENGTH.pack(len(data)) + data)
        except OSError as exc:
            self._die(f"the session did not start: {exc}")
            return
        result = self._wait_for("epilogue", min(self.deadline, time.monotonic() + max(5.0, lim.cell_wall_seconds)))
        if result.status != "ok" and self.dead is None:
            self._die(f"the session's setup failed: {result.error or result.status}")
        self.setup_result = result

    def close(self) -> list[Artifact]:
        """End the session: its processes are gone when this returns; the declared artifacts are collected."""
        if self.closed:
            return self.artifacts
        self.closed = True
        standby = self.standby
        if standby.go_w >= 0:  # the harness's next read sees EOF: it ends, killing what the cells left
            with contextlib.suppress(OSError):
                os.close(standby.go_w)
            standby.go_w = -1
            readable(standby.pidfd, 0.5)
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(standby.pidfd, signal.SIGKILL)  # its init: the namespace goes with it
        readable(standby.pidfd, 5.0)
        runner = self.zygote.runner
        if self.spec.artifacts:
            self.artifacts = collect_artifacts(runner.path(standby, "work"), self.spec.artifacts)
        self.pool._release(self)
        self.lease.unlink(missing_ok=True)
        return self.artifacts

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _die(self, why: str) -> None:
        self.dead = why
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(self.standby.pidfd, signal.SIGKILL)

    # ------------------------------------------------------------ cells

    def run(self, code: str, wall_seconds: float | None = None) -> CellResult:
        """Run one cell; its status says how it ended. A dead session answers ``session_error``."""
        if self.closed:
            raise RuntimeError("this session is closed")
        if self.dead is None and time.monotonic() >= self.deadline:
            self._die(f"the episode's deadline ({self.limits.deadline_seconds:.0f} s) passed")
        if self.dead is not None:
            return CellResult("session_error", error=self.dead)
        data = marshal.dumps(code)
        started = time.monotonic()
        try:
            _write_all(self.standby.go_w, JOB_LENGTH.pack(len(data)) + data)
        except OSError as exc:
            self._die(f"the session is gone ({exc.strerror})")
            return CellResult("session_error", error=self.dead)
        limit = min(wall_seconds or self.limits.cell_wall_seconds, self.limits.cell_wall_seconds)
        return self._wait_for("cell", min(self.deadline, started + limit), interruptible=True)

    def _cpu_since_mark(self) -> float | None:
        cgroup = self.standby.cgroup
        if cgroup is None or self._cpu_mark is None:
            return None
        now = cgroup.cpu_seconds()
        if now is None:
            return None
        used, self._cpu_mark = max(0.0, now - self._cpu_mark), now
        return used

    def _wait_for(self, kind: str, deadline: float, interruptible: bool = False) -> CellResult:
        """Read output and frames until the frame ``kind`` arrives (or a limit, or the session's end)."""
        standby, cap = self.standby, self.limits.max_output_bytes
        out, err = bytearray(), bytearray()
        poller = select.poll()
        for fd in (standby.out_r, standby.err_r, standby.rep_r, standby.pidfd):
            poller.register(fd, select.POLLIN)
        started = time.monotonic()
        interrupted_at: float | None = None
        timed_out = False
        while True:
            wait_until = deadline if interrupted_at is None else interrupted_at + INTERRUPT_GRACE_S
            events = poller.poll(max(0, int((wait_until - time.monotonic()) * 1000)) + 1)
            for fd, _ in events:
                if fd == standby.pidfd:
                    continue
                if fd == standby.rep_r:
                    chunk = bytearray()
                    _drain(fd, chunk, 1 << 20)
                    try:
                        frames = self.reader.feed(bytes(chunk))
                    except ReportTampered as exc:
                        self._die(f"the session's report channel was tampered with ({exc})")
                        return CellResult("session_error", _text(out), _text(err), self.dead,
                                          time.monotonic() - started)
                    for frame in frames:
                        if frame.get("k") == kind or (kind == "epilogue" and frame.get("k") == "code"
                                                      and frame.get("completed") is False):
                            _drain(standby.out_r, out, cap * 16)
                            _drain(standby.err_r, err, cap * 16)
                            ok = frame.get("ok", frame.get("completed", True))
                            if kind == "epilogue" and frame.get("k") == "code":
                                return CellResult("error", _text(out, cap), _text(err, cap), frame.get("error"),
                                                  time.monotonic() - started, self._cpu_since_mark())
                            status: CellStatus = "ok" if ok else "error"
                            error = frame.get("error")
                            if timed_out:
                                status, error = "timeout", (f"the cell ran past its {self.limits.cell_wall_seconds:g} s "
                                                            f"limit and was interrupted")
                            return CellResult(status, _text(out, cap), _text(err, cap), error,
                                              time.monotonic() - started, self._cpu_since_mark(),
                                              len(out) > cap or len(err) > cap)
                elif fd == standby.out_r:
                    _drain(fd, out, cap * 16)
                else:
                    _drain(fd, err, cap * 16)
            if len(out) > cap * 16 or len(err) > cap * 16:
                self._die("the cell flooded its output: the session was killed")
                return CellResult("output_limit", _text(out, cap), _text(err, cap), self.dead,
                                  time.monotonic() - started, None, True)
            if readable(standby.pidfd, 0):
                _drain(standby.out_r, out, cap * 16)
                _drain(standby.err_r, err, cap * 16)
                why = self._death_reason()
                self._die(why)
                return CellResult("timeout" if "CPU" in why or timed_out else "session_error", _text(out, cap),
                                  _text(err, cap), why, time.monotonic() - started)
            now = time.monotonic()
            if interrupted_at is None and now >= deadline:
                if not interruptible or now >= self.deadline:
                    self._die("the episode's deadline passed" if now >= self.deadline else "setup timed out")
                    return CellResult("timeout" if interruptible else "session_error", _text(out, cap),
                                      _text(err, cap), self.dead, now - started)
                timed_out, interrupted_at = True, now
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(standby.pidfd, signal.SIGINT)
            elif interrupted_at is not None and now >= interrupted_at + INTERRUPT_GRACE_S:
                self._die(f"the cell ran past its {self.limits.cell_wall_seconds:g} s limit and would not stop: "
                          "the session was killed")
                return CellResult("timeout", _text(out, cap), _text(err, cap), self.dead, now - started)

    def _death_reason(self) -> str:
        ended = self.pool._exit_status(self.zygote, self.standby.ident)
        if ended is None:
            return "the session ended"
        code = os.waitstatus_to_exitcode(ended[0])
        if code == -signal.SIGKILL and ended[1] >= self.limits.cpu_seconds * 0.95:
            return f"the session used its {self.limits.cpu_seconds:g} s of CPU and was killed"
        if self.standby.cgroup is not None and self.standby.cgroup.oom_killed():
            return "the session ran out of memory and was killed"
        return f"the session ended (exit status {code})"

    def files(self) -> list[str]:
        """The work directory's files now (relative paths), for an environment that shows them."""
        root = self.zygote.runner.path(self.standby, "work")
        return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "**"), recursive=True)
                      if os.path.isfile(p))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _text(data: bytearray, cap: int | None = None) -> str:
    return bytes(data[:cap] if cap is not None else data).decode("utf-8", "replace")


# ---------------------------------------------------------------- the pool


class SessionPool:
    """Warm zygotes (one per runtime, the default's started now, others on first use, their images built
    first if need be) that hand out sessions; thread-safe. Its watchdog kills sessions past their deadline
    (also ones whose caller is stuck) and sweeps leases left by owners that died."""

    def __init__(self, watchdog_seconds: float = 0.5) -> None:
        sweep()
        self.owner_pid = os.getpid()
        self.zygotes: dict[str, _Zygote] = {"python": _Zygote("python", None)}
        self.tier = self.zygote.tier
        self._lock = threading.Lock()
        self._open: dict[int, Session] = {}
        self._closed = False
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, args=(watchdog_seconds,), daemon=True,
                                          name="temper-session-watchdog")
        self._watchdog.start()

    @property
    def zygote(self) -> _Zygote:
        """The default runtime's zygote."""
        return self.zygotes["python"]

    def _zygote_for(self, runtime: str) -> _Zygote:
        """The runtime's zygote, started (and its image built) on first use; raises with the reason when
        the runtime is unknown or its image cannot be built."""
        with self._lock:
            zygote = self.zygotes.get(runtime)
            if zygote is not None and zygote.alive():
                return zygote
        launch, _ = launch_for(runtime)  # outside the lock: a build takes seconds
        fresh = _Zygote(runtime, None, launch)
        with self._lock:
            old = self.zygotes.get(runtime)
            if old is not None and old.alive():  # another thread started one meanwhile
                fresh.close()
                return old
            self.zygotes[runtime] = fresh
            return fresh

    def open(self, spec: SessionSpec | None = None) -> Session:
        if self._closed:
            raise RuntimeError("this SessionPool is closed")
        spec = spec or SessionSpec()
        zygote = self._zygote_for(spec.runtime)
        with self._lock:
            standby = zygote._take()
            zygote.active.add(standby.ident)
        session = Session(self, standby, spec, zygote)
        with self._lock:
            self._open[id(session)] = session  # (idents are per zygote)
        return session

    @contextlib.contextmanager
    def session(self, spec: SessionSpec | None = None) -> Iterator[Session]:
        session = self.open(spec)
        try:
            yield session
        finally:
            session.close()

    def _remount(self, zygote: _Zygote, ident: int, size: int) -> None:
        with self._lock:
            zygote._remount(ident, size)

    def _exit_status(self, zygote: _Zygote, ident: int) -> tuple[int, float, int] | None:
        with self._lock:
            return zygote._exit_status(ident, 2.0)

    def _release(self, session: Session) -> None:
        zygote = session.zygote
        with self._lock:
            self._open.pop(id(session), None)
            zygote.active.discard(session.standby.ident)
            zygote.exits.pop(session.standby.ident, None)
            zygote._release(session.standby)

    def _watch(self, every: float) -> None:
        while not self._stop.wait(every):
            now = time.monotonic()
            with self._lock:
                late = [s for s in self._open.values() if now >= s.deadline and s.dead is None]
            for session in late:
                session._die(f"the episode's deadline ({session.limits.deadline_seconds:.0f} s) passed")
            with contextlib.suppress(Exception):
                sweep()

    def live(self) -> int:
        with self._lock:
            return len(self._open)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for session in list(self._open.values()):
            with contextlib.suppress(Exception):
                session.close()
        for zygote in self.zygotes.values():
            zygote.close()

    def __enter__(self) -> SessionPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



_default: SessionPool | None = None
_default_lock = threading.Lock()


def default_pool() -> SessionPool:
    """The process-wide session pool (created on first use; a forked child makes its own)."""
    global _default
    with _default_lock:
        if _default is None or _default._closed or _default.owner_pid != os.getpid():
            _default = SessionPool()
        return _default
