"""The public data types of the sandbox: what to run (`SandboxSpec`, `Limits`) and what happened
(`SandboxResult`, `HarnessReport`, `StatementOutcome`, `Artifact`).

Plain frozen dataclasses with no behaviour beyond validation and `to_dict()`, so that verifiers,
Celery tasks and tests can build and inspect them without starting anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["ok", "nonzero_exit", "timeout", "memory_limit", "output_limit", "killed", "sandbox_error"]

STATUSES: tuple[Status, ...] = (
    "ok",
    "nonzero_exit",
    "timeout",
    "memory_limit",
    "output_limit",
    "killed",
    "sandbox_error",
)


@dataclass(frozen=True)
class Limits:
    """Resource limits of one execution, all enforced from outside the untrusted code."""

    cpu_seconds: float = 5.0
    """CPU time per process (RLIMIT_CPU: SIGXCPU, then SIGKILL one second later). Reported as `timeout`."""
    wall_seconds: float = 10.0
    """Wall-clock time of the whole execution (code, epilogue, command); the whole tree is then killed."""
    memory_bytes: int = 512 << 20
    """Memory of the whole tree (cgroup) where the tier has one, else address space per process."""
    max_processes: int = 32
    """Processes and threads of the whole tree (cgroup pids; without a cgroup, RLIMIT_NPROC of the
    sandbox uid, which the zygote's waiting standbys share)."""
    max_file_bytes: int = 16 << 20
    """Largest file the code may write (RLIMIT_FSIZE)."""
    max_open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_output_bytes: int = 1 << 20
    """Bytes kept of stdout and of stderr each; writing more kills the execution (`output_limit`)."""
    disk_bytes: int = 64 << 20
    """Size of the private writable tmpfs holding the work directory (a full disk gives ENOSPC)."""

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("memory_bytes", "max_processes", "max_file_bytes", "max_open_files", "max_output_bytes",
                     "disk_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_open_files < 8:
            raise ValueError("Limits.max_open_files must be >= 8 (the interpreter itself needs a few)")

    def to_dict(self) -> dict[str, float | int]:
        return {
            "cpu_seconds": self.cpu_seconds,
            "wall_seconds": self.wall_seconds,
            "memory_bytes": self.memory_bytes,
            "max_processes": self.max_processes,
            "max_file_bytes": self.max_file_bytes,
            "max_open_files": self.max_open_files,
            "max_output_bytes": self.max_output_bytes,
            "disk_bytes": self.disk_bytes,
        }


@dataclass(frozen=True)
class SandboxSpec:
    """One execution: untrusted `code`, then the trusted `epilogue`, then an optional `command`."""

    code: str
    """Untrusted Python source, run as `__main__` with the work directory as cwd."""
    runtime: str = "python"
    """Which runtime's warm interpreters run it (``sandboxes.runtimes``): "python", the host interpreter with
    its standard library only, or a defined runtime whose read-only image holds its packages."""
    files: Mapping[str, str | bytes] = field(default_factory=dict)
    """Read-only inputs placed in the work directory (root-owned, 0444, sticky directory)."""
    writable_files: Mapping[str, str | bytes] = field(default_factory=dict)
    """Inputs the code may modify or delete."""
    artifacts: Sequence[str] = ()
    """Glob patterns, relative to the work directory, collected after every execution."""
    epilogue: str | Sequence[str] | None = None
    """TRUSTED Python run after `code` in the same interpreter and namespace; one outcome per top-level
    statement, each run even if an earlier one failed. Parsed and compiled outside the sandbox, once per
    distinct text; a sequence of chunks (each parsing on its own, run as if joined line after line) lets a
    caller that varies only one small chunk per execution reuse the compilation of the others."""
    stdin: bytes = b""
    limits: Limits = field(default_factory=Limits)
    command: Sequence[str] | None = None
    """An argv run after `code` (and `epilogue`) in the same sandbox and work directory; its exit code is
    reported in `HarnessReport.command_exit_code`."""

    def __post_init__(self) -> None:
        for mapping_name in ("files", "writable_files"):
            for name in getattr(self, mapping_name):
                check_relative_path(name, f"SandboxSpec.{mapping_name}")
        overlap = set(self.files) & set(self.writable_files)
        if overlap:
            raise ValueError(f"SandboxSpec: {sorted(overlap)} in both files and writable_files")
        for pattern in self.artifacts:
            check_relative_path(pattern, "SandboxSpec.artifacts")
        if self.epilogue is not None and not isinstance(self.epilogue, str) and (
            isinstance(self.epilogue, bytes) or not all(isinstance(c, str) for c in self.epilogue)
        ):
            raise ValueError("SandboxSpec.epilogue must be a string or a sequence of strings")
        if self.command is not None and (isinstance(self.command, str) or not self.command):
            raise ValueError("SandboxSpec.command must be a non-empty argv list, e.g. ['bash', 'test.sh']")


def check_relative_path(name: str, where: str) -> None:
    """Reject absolute paths, '..' and empty names in work-directory paths."""
    parts = name.split("/")
    if not name or name.startswith("/") or ".." in parts or "" in parts or "\0" in name:
        raise ValueError(f"{where}: {name!r} must be a relative path inside the work directory")


@dataclass(frozen=True)
class Artifact:
    """A file collected from the work directory after the execution."""

    path: str
    size: int
    sha256: str
    data: bytes | None
    """The content, or None when the file was larger than the artifact size cap."""

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256,
                "data_included": self.data is not None}


@dataclass(frozen=True)
class StatementOutcome:
    """The outcome of one top-level statement of the epilogue."""

    index: int
    lineno: int
    source: str
    ok: bool
    error: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "lineno": self.lineno, "source": self.source, "ok": self.ok,
                "error": self.error}


@dataclass(frozen=True)
class HarnessReport:
    """What the trusted in-sandbox harness reported over the authenticated report channel.

    Parts the harness never reached (the process died first) are reported as not completed / failed.
    """

    code_completed: bool
    code_error: str | None
    statements: list[StatementOutcome]
    epilogue_completed: bool
    command_exit_code: int | None

    @property
    def all_passed(self) -> bool:
        """Code ran to its end, every epilogue statement passed and the command (if any) exited 0."""
        return (
            self.code_completed
            and self.epilogue_completed
            and all(s.ok for s in self.statements)
            and self.command_exit_code in (None, 0)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "code_completed": self.code_completed,
            "code_error": self.code_error,
            "statements": [s.to_dict() for s in self.statements],
            "epilogue_completed": self.epilogue_completed,
            "command_exit_code": self.command_exit_code,
        }


@dataclass(frozen=True)
class SandboxResult:
    """The verdict of one execution, computed outside the sandbox."""

    status: Status
    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    cpu_seconds: float
    wall_seconds: float
    peak_memory_bytes: int | None
    artifacts: list[Artifact]
    tier: str
    report: HarnessReport | None
    error: str | None
    runtime: str = "python"
    warm: bool | None = None
    """Whether a warm zygote ran it (False: this execution started its runtime's zygote: a cold start)."""
    attempts: int = 1
    """Zygotes tried: more than one after an infrastructure failure (see ``SandboxPool.run``)."""
    build_seconds: float = 0.0
    """The image build this execution waited for (0 when its runtime's image was already built)."""

    @property
    def passed(self) -> bool:
        """The execution ended normally and the authenticated report says everything passed."""
        return self.status == "ok" and self.report is not None and self.report.all_passed

    def to_dict(self, max_text_bytes: int = 4096) -> dict[str, Any]:
        """A JSON-able summary; stdout/stderr are decoded (replacing invalid UTF-8) and cut."""
        return {
            "status": self.status,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "stdout": _text(self.stdout, max_text_bytes),
            "stderr": _text(self.stderr, max_text_bytes),
            "stdout_bytes": len(self.stdout),
            "stderr_bytes": len(self.stderr),
            "stdout_truncated": self.stdout_truncated,
            "stderr_truncated": self.stderr_truncated,
            "cpu_seconds": round(self.cpu_seconds, 6),
            "wall_seconds": round(self.wall_seconds, 6),
            "peak_memory_bytes": self.peak_memory_bytes,
            "artifacts": [a.to_dict() for a in self.artifacts],
            "tier": self.tier,
            "report": None if self.report is None else self.report.to_dict(),
            "error": self.error,
            "runtime": self.runtime,
            "warm": self.warm,
            "attempts": self.attempts,
            "build_seconds": round(self.build_seconds, 3),
        }


def _text(data: bytes, limit: int) -> str:
    text = data[:limit].decode("utf-8", errors="replace")
    return text if len(data) <= limit else text + f"\n…[{len(data) - limit} more bytes]"

