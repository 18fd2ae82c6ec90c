"""The owner side of an execution: hand a job to a warm standby, supervise it, and judge it.

Runs in the process that owns the pool (a Celery worker, a test, the CLI) — outside every sandbox. Given
a standby (fds and pid received from the zygote), it writes the inputs into the standby's work directory,
sends the job, enforces the wall clock and the output caps while reading, kills the whole namespace on a
limit, then computes the verdict from what it observed (the authenticated report, cgroup counters, and
the init's wait status when the report is incomplete) and collects the artifacts, never following a link
out of the work directory. A complete report (the harness's "end" frame, then the report pipe hung up:
the harness has killed and reaped everything else and closed its fds) is the verdict's cue — the kernel's
teardown of the process and its namespaces is not waited for.

Doing this in the owner rather than in the zygote saves two process hand-offs per execution.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import itertools
import marshal
import os
import secrets
import select
import signal
import stat
import time
from collections.abc import Callable
from typing import Any

from sandboxes.api import Artifact, HarnessReport, SandboxResult, SandboxSpec, StatementOutcome, Status
from sandboxes.harness import MAX_REPORT_BYTES, ReportTampered, decode_frames, prepare_epilogue
from sandboxes.protocol import JOB_LENGTH, Standby, readable
from sandboxes.zygote import DEFAULT_DISK, DEFAULT_LIMITS, SANDBOX_ROOT

MAX_ARTIFACTS = 100
MAX_ARTIFACT_CANDIDATES = 1000
MAX_ARTIFACT_BYTES = 8 << 20
MAX_ARTIFACTS_TOTAL = 32 << 20


class Runner:
    """What the owner knows about one zygote, and the execution logic."""

    def __init__(self, hello: dict[str, Any]) -> None:
        self.tier: str = hello["tier"]
        self.namespaces: bool = hello["namespaces"]
        self.uid: int | None = hello["uid"] if hello["drop_privileges"] else None
        # The zygote's slots live in its private mount namespace; root reaches them through /proc.
        self.prefix = f"/proc/{hello['pid']}/root" if self.namespaces else ""

    def path(self, standby: Standby, *parts: str) -> str:
        return os.path.join(self.prefix + standby.slot, *parts)

    def execute(self, standby: Standby, spec: SandboxSpec, remount: Callable[[int, int], None],
                exit_status: Callable[[int, float], tuple[int, float, int] | None]
                ) -> tuple[SandboxResult, float | None]:
        """Run `spec` on `standby` (used once; the caller releases it afterwards)."""
        try:
            statements, epilogue = prepare_epilogue(spec.epilogue) if spec.epilogue is not None else ([], [])
        except (SyntaxError, ValueError) as exc:
            return error_result(self.tier, f"the epilogue does not compile: {exc}"), None
        self._prepare(standby, spec, remount)
        key = secrets.token_bytes(32)
        limits = spec.limits
        # Plain values only, marshalled: loading them runs no Python code in the sandbox (see zygote.py).
        job = (spec.code, os.path.join(SANDBOX_ROOT if self.namespaces else standby.slot, "main.py"), epilogue,
               list(spec.command) if spec.command is not None else None, key,
               (limits.cpu_seconds, limits.max_file_bytes, limits.max_open_files, limits.max_processes,
                limits.memory_bytes))
        data = marshal.dumps(job)
        return self._supervise(standby, spec, key, statements, JOB_LENGTH.pack(len(data)) + data, exit_status)

    def _prepare(self, standby: Standby, spec: SandboxSpec, remount: Callable[[int, int], None]) -> None:
        limits = spec.limits
        if self.namespaces and limits.disk_bytes != DEFAULT_DISK:
            remount(standby.ident, limits.disk_bytes)
        if standby.cgroup is not None:
            if (limits.memory_bytes, limits.max_processes) != (DEFAULT_LIMITS.memory_bytes,
                                                               DEFAULT_LIMITS.max_processes):
                standby.cgroup.configure(limits.memory_bytes, limits.max_processes)
            standby.cgroup.reset_peak()
        _put(self.path(standby, "main.py"), spec.code, 0o444, None, nested=False)
        for name, content in spec.files.items():
            _put(self.path(standby, "work", name), content, 0o444, None, nested="/" in name)
        for name, content in spec.writable_files.items():
            _put(self.path(standby, "work", name), content, 0o644, self.uid, nested="/" in name)
        if spec.stdin:
            _write_all(standby.stdin_fd, spec.stdin)
            os.lseek(standby.stdin_fd, 0, os.SEEK_SET)  # D's fd 0 shares this file offset

    def _supervise(self, standby: Standby, spec: SandboxSpec, key: bytes, statements: list[Any], job: bytes,
                   exit_status: Callable[[int, float], tuple[int, float, int] | None]
                   ) -> tuple[SandboxResult, float | None]:
        limits = spec.limits
        cpu_before = standby.cgroup.cpu_seconds() if standby.cgroup is not None else None
        with contextlib.suppress(OSError):  # back to normal priority (needs root; else it stays low)
            os.setpriority(os.PRIO_PROCESS, standby.pid, 0)
        started = time.monotonic()
        with contextlib.suppress(OSError):  # the sandbox is gone; its exit status tells
            _write_all(standby.go_w, job)
        os.close(standby.go_w)
        standby.go_w = -1
        stdout, stderr, report = bytearray(), bytearray(), bytearray()
        out_trunc = err_trunc = False
        reason: Status | None = None
        deadline = started + limits.wall_seconds
        open_fds = {standby.out_r: stdout, standby.err_r: stderr, standby.rep_r: report}
        caps = {standby.out_r: limits.max_output_bytes, standby.err_r: limits.max_output_bytes,
                standby.rep_r: MAX_REPORT_BYTES}
        poller = select.poll()
        for fd in (standby.out_r, standby.err_r, standby.pidfd):
            poller.register(fd, select.POLLIN)
        # The report pipe is read once (its buffer holds a whole report), so it is watched for hang-up only:
        # the harness, done, closes every fd — one wake-up, not one per frame.
        poller.register(standby.rep_r, 0)
        exited = finished = False
        messages: list[dict[str, Any]] | None = None  # the verified report, once complete
        while not (exited or finished) and reason is None:
            timeout_ms = max(0, int((deadline - time.monotonic()) * 1000) + 1)
            events = poller.poll(min(timeout_ms, 1000))
            if not events and time.monotonic() >= deadline:
                reason = "timeout"
                break
            for fd, _ in events:
                if fd == standby.pidfd:
                    exited = True
                elif fd == standby.rep_r:
                    poller.unregister(fd)  # it stays hung up: watch the process from here on
                    _drain(fd, report, MAX_REPORT_BYTES)
                    # Without a cgroup the CPU time comes from the zygote's wait: wait for the exit then.
                    messages = _complete_report(key, report) if standby.cgroup is not None else None
                    finished = messages is not None
                elif fd in open_fds:
                    buffer = open_fds[fd]
                    if not _drain(fd, buffer, caps[fd]):
                        poller.unregister(fd)
                        del open_fds[fd]
                    if len(buffer) > caps[fd]:
                        if fd == standby.out_r:
                            out_trunc = True
                        elif fd == standby.err_r:
                            err_trunc = True
                        reason = "output_limit"
        wall = time.monotonic() - started
        if finished and not exited:
            # The authenticated report is complete: the harness has killed and reaped every other process
            # of the execution and closed its fds. Kill its init too (in case the "end" came from anywhere
            # but the real harness) and let the kernel tear it down while we judge: the zygote frees the
            # slot only once it has reaped it.
            self._kill_tree(standby)
        elif not exited:
            # A limit: kill the namespace's init; the kernel kills everything else in it. Its pidfd turns
            # readable only once the whole namespace is gone.
            self._kill_tree(standby)
            readable(standby.pidfd)
        if not self.namespaces:
            self._kill_tree(standby)  # no PID namespace: the process group is all we can reach
        # Every writer is gone now: read what is left (the caps still apply).
        for fd, buffer in list(open_fds.items()):
            _drain(fd, buffer, caps[fd])
        if len(stdout) > limits.max_output_bytes:
            out_trunc = True
            del stdout[limits.max_output_bytes :]
        if len(stderr) > limits.max_output_bytes:
            err_trunc = True
            del stderr[limits.max_output_bytes :]

        harness_report, start_t, report_error, end_exit = parse_report(key, bytes(report), statements,
                                                                       spec.command is not None, messages)
        cgroup = standby.cgroup
        cpu: float | None = None
        maxrss = 0
        if cgroup is not None and cpu_before is not None:
            cpu_after = cgroup.cpu_seconds()
            if cpu_after is not None:
                cpu = max(0.0, cpu_after - cpu_before)
        exit_code: int | None = end_exit
        sig: int | None = None
        if end_exit is None or cpu is None or reason is not None:
            # No authenticated "end" (os._exit, a signal, a kill): ask the zygote, the parent, how it ended.
            ended = exit_status(standby.ident, 5.0)
            if ended is not None:
                code = os.waitstatus_to_exitcode(ended[0])
                exit_code, sig = (code, None) if code >= 0 else (None, -code)
                if cpu is None:
                    cpu, maxrss = ended[1], ended[2]
        peak = cgroup.peak_memory() if cgroup is not None else maxrss * 1024
        oom = cgroup is not None and cgroup.oom_killed()
        status, exit_code, sig, error = verdict(reason, exit_code, sig, cpu or 0.0, limits.cpu_seconds, oom,
                                                harness_report)
        if report_error is not None and status != "sandbox_error":
            error = report_error if error is None else f"{error}; {report_error}"
        artifacts = collect_artifacts(self.path(standby, "work"), spec.artifacts)
        result = SandboxResult(
            status=status,
            exit_code=exit_code,
            signal=sig,
            stdout=bytes(stdout),
            stderr=bytes(stderr),
            stdout_truncated=out_trunc,
            stderr_truncated=err_trunc,
            cpu_seconds=cpu or 0.0,
            wall_seconds=wall,
            peak_memory_bytes=peak,
            artifacts=artifacts,
            tier=self.tier,
            report=harness_report,
            error=error,
        )
        return result, start_t

    def _kill_tree(self, standby: Standby) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.namespaces:
                # PID 1 of the namespace (through its pidfd, so never a recycled pid): the kernel kills
                # everything else in it.
                signal.pidfd_send_signal(standby.pidfd, signal.SIGKILL)
            else:
                os.killpg(standby.pid, signal.SIGKILL)


def _put(path: str, content: str | bytes, mode: int, owner: int | None, nested: bool = True) -> None:
    if nested:  # (a file at the top of the slot or work directory needs no parent made)
        os.makedirs(os.path.dirname(path), exist_ok=True)
    data = content.encode() if isinstance(content, str) else content
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data) if len(data) < (1 << 20) else _write_all(fd, data)
        os.fchmod(fd, mode)
        if owner is not None:
            os.fchown(fd, owner, owner)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _drain(fd: int, buffer: bytearray, cap: int) -> bool:
    """Read what is available; False at EOF. Stops one byte past the cap (enough to know it was hit)."""
    while len(buffer) <= cap:
        try:
            chunk = os.read(fd, min(1 << 16, cap + 1 - len(buffer)))
        except BlockingIOError:
            return True
        except OSError as exc:
            if exc.errno == errno.EINTR:
                continue
            return False
        if not chunk:
            return False
        buffer += chunk
    return True


def _complete_report(key: bytes, data: bytearray) -> list[dict[str, Any]] | None:
    """The report's frames when it is an untampered stream ending with the harness's "end" frame."""
    try:
        messages = decode_frames(key, bytes(data))
    except ReportTampered:
        return None
    return messages if messages and messages[-1].get("k") == "end" else None


def verdict(
    reason: Status | None,
    exit_code: int | None,
    sig: int | None,
    cpu: float,
    cpu_limit: float,
    oom: bool,
    report: HarnessReport | None,
) -> tuple[Status, int | None, int | None, str | None]:
    """status, exit_code, signal, error from what was observed outside."""
    if reason == "timeout":
        return "timeout", exit_code, sig, "wall-clock limit exceeded; the whole process tree was killed"
    if reason == "output_limit":
        return "output_limit", exit_code, sig, "stdout/stderr limit exceeded; the whole process tree was killed"
    if oom:
        return "memory_limit", exit_code, sig, "memory limit exceeded (out-of-memory kill)"
    if sig in (signal.SIGXCPU,) or (sig == signal.SIGKILL and cpu >= cpu_limit * 0.95):
        return "timeout", exit_code, sig, "CPU-time limit exceeded"
    if exit_code is None and sig is None:
        return "sandbox_error", None, None, "the sandbox ended without an exit status"
    if report is not None and report.code_error is not None and report.code_error.startswith("MemoryError"):
        return "memory_limit", exit_code, sig, "memory limit exceeded (MemoryError)"
    if sig is not None:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        return "killed", exit_code, sig, f"killed by signal {name}"
    if exit_code == 0:
        return "ok", exit_code, None, None
    return "nonzero_exit", exit_code, None, None


def parse_report(key: bytes, data: bytes, statements: list[Any], has_command: bool,
                 decoded: list[dict[str, Any]] | None = None
                 ) -> tuple[HarnessReport | None, float | None, str | None, int | None]:
    """The harness report from the verified frames (`decoded`: `data` already verified and decoded);
    None when the stream was tampered with."""
    try:
        messages = decoded if decoded is not None else decode_frames(key, data)
    except ReportTampered as exc:
        return None, None, f"report channel tampered with ({exc}); report discarded", None
    expected = ["start", "code"] + ["stmt"] * len(statements) + ["epilogue"]
    if has_command:
        expected.append("command")
    expected.append("end")
    kinds = [m.get("k") for m in messages]
    if kinds != expected[: len(kinds)]:
        return None, None, "report channel tampered with (unexpected frame order); report discarded", None
    if not messages:
        return None, None, "the sandbox ended before the harness started", None
    by_kind: dict[str, dict[str, Any]] = {}
    outcomes: list[dict[str, Any]] = []
    for message in messages:
        if message["k"] == "stmt":
            if message.get("i") != len(outcomes):
                return None, None, "report channel tampered with (statement index); report discarded", None
            outcomes.append(message)
        else:
            by_kind[message["k"]] = message
    code = by_kind.get("code")
    outcome_list = []
    for index, statement in enumerate(statements):
        outcome = outcomes[index] if index < len(outcomes) else None
        outcome_list.append(
            StatementOutcome(
                index=index,
                lineno=statement.lineno,
                source=statement.source,
                ok=bool(outcome and outcome.get("ok") is True),
                error=(outcome.get("error") if outcome else "not run: the sandbox ended before it"),
            )
        )
    command = by_kind.get("command")
    report = HarnessReport(
        code_completed=bool(code and code.get("completed") is True),
        code_error=(code.get("error") if code else "the process ended before the code finished "
                    "(os._exit, a signal or a limit)"),
        statements=outcome_list,
        epilogue_completed="epilogue" in by_kind,
        command_exit_code=(int(command["exit"]) if command and command.get("exit") is not None else None),
    )
    start = by_kind.get("start", {}).get("t")
    end = by_kind.get("end", {}).get("exit")
    return (report, (float(start) if isinstance(start, (int, float)) else None), None,
            end if type(end) is int else None)


def collect_artifacts(workdir: str, patterns: Any) -> list[Artifact]:
    """Regular files matching the patterns, opened one path component at a time without following links.

    (Never realpath: under /proc/<pid>/root a resolved path would name the owner's file system.)
    """
    if not patterns:
        return []
    names: dict[str, None] = {}
    for pattern in patterns:
        matches = glob.iglob(pattern, root_dir=workdir, recursive=True)
        for name in sorted(itertools.islice(matches, MAX_ARTIFACT_CANDIDATES)):
            names[name] = None
    artifacts: list[Artifact] = []
    total = 0
    for name in names:
        if len(artifacts) >= MAX_ARTIFACTS:
            break
        fd = _open_beneath(workdir, name)
        if fd is None:
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                continue
            keep = info.st_size <= MAX_ARTIFACT_BYTES and total + info.st_size <= MAX_ARTIFACTS_TOTAL
            digest = hashlib.sha256()
            chunks = []
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                digest.update(chunk)
                if keep:
                    chunks.append(chunk)
            data = b"".join(chunks) if keep else None
            total += len(data or b"")
            artifacts.append(Artifact(name, info.st_size, digest.hexdigest(), data))
        finally:
            os.close(fd)
    return artifacts


def _open_beneath(root: str, name: str) -> int | None:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    try:
        current = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        for part in parts[:-1]:
            following = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=current)
            os.close(current)
            current = following
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=current)
    except OSError:
        return None
    finally:
        os.close(current)


def error_result(tier: str, error: str) -> SandboxResult:
    return SandboxResult(
        status="sandbox_error", exit_code=None, signal=None, stdout=b"", stderr=b"", stdout_truncated=False,
        stderr_truncated=False, cpu_seconds=0.0, wall_seconds=0.0, peak_memory_bytes=None, artifacts=[],
        tier=tier, report=None, error=error,
    )


