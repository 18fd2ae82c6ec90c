"""Isolated, pre-warmed execution of untrusted code (model output and the tests run against it).

    from sandboxes import SandboxSpec, Limits, run
    result = run(SandboxSpec(code=solution, epilogue="assert add(1, 2) == 3", limits=Limits(wall_seconds=5)))
    result.passed, result.status, result.report

What IS isolated, in the "namespaces+cgroup" tier (root, or a machine that allows it):
- PID namespace: the code runs as PID 1 of its own namespace and sees only its own processes; before
  the verdict is returned everything else in the namespace — daemons, grandchildren, fork bombs — has
  been killed: by the harness, which kills and reaps them once the epilogue and command are done, or by
  the kernel when the init ends or is killed. (Being init, signals it sends itself with the default action
  are ignored; the kernel's own — the hard CPU limit's SIGKILL, a segfault — still kill it.)
- Network namespace with no interface up: no network at all, not even the host's loopback services.
- Mount namespace: the whole system root is read-only and nosuid; /tmp is a fresh tmpfs of
  `Limits.disk_bytes` (noexec) holding the work directory; /proc is a fresh one for the new PID namespace.
- IPC and UTS namespaces (hostname "sandbox").
- Credentials: a per-zygote unmapped uid/gid (1000000 + zygote pid), no supplementary groups,
  no_new_privs, non-dumpable. Root-only files such as /etc/shadow are unreadable; a directory the
  interpreter lives in but other users cannot enter (pyenv under /root) is covered by an empty tmpfs
  that re-exposes only the interpreter.
- Environment: built from scratch (PATH, LANG, HOME=/tmp, ...); the zygote itself is started with that
  environment, so /proc/*/environ shows no worker variable or secret either.
- Limits: cgroup memory and pids per execution (cgroup v1 or v2; v2 is implemented but this project's
  machines have v1); rlimits for CPU time, file size, open files, core dumps; wall time and stdout/stderr bytes enforced from outside by the owner process (the pool),
  which reads the output while it runs and kills the whole namespace on a limit.
- Fresh state by construction: each execution is a new process forked from a pristine zygote, with a new
  tmpfs and namespaces, used once and destroyed; its cgroup is new, or one its zygote recycled after
  verifying it empty, with the limits and counters reset.
- Inputs in `SandboxSpec.files` are root-owned 0444 in a sticky directory: the code cannot modify,
  delete or rename them.
- The verdict is computed outside the sandbox from the process status and an HMAC-authenticated report
  stream (see `sandboxes.harness`); stdout and the exit code alone are never trusted.

How it is fast: a warm zygote per runtime keeps two sandboxes pre-forked and fully isolated, waiting for
a job with the harness already set up (`sandboxes.zygote`); the owner hands one a job (the epilogue
already compiled, once per distinct text), supervises it and judges it (`sandboxes.runner`), so an
execution costs no interpreter start, no namespace set-up, no import and no parse of trusted code on its
path — and the verdict is returned as soon as the authenticated report is complete, while the kernel is
still tearing the sandbox's process and namespaces down.

What is NOT isolated:
- The kernel is shared (no seccomp filter, no gVisor/VM): a kernel exploit escapes.
- Read access to the world-readable parts of the host file system (/usr, /etc/passwd, the project's
  source, /sys) — read-only, but visible. Do not put secrets in world-readable files on sandbox hosts.
  Through /sys an execution can read cgroup statistics: other sandboxes' usage, the parent's totals, and
  the cumulative counters (memory.stat) its own recycled cgroup kept from earlier executions.
- CPU share: there is no CPU cgroup; a spinning execution competes for cores until its CPU or wall limit.
- /dev is the host's (read-only; device nodes stay usable per their permissions, e.g. /dev/null).
- The harness runs in the same interpreter as the untrusted code; a determined attacker that walks
  stack frames can in principle forge the report (see `sandboxes.harness` for the measures and the
  residual risk). ctypes, gc object walking, trace functions and new audit hooks are refused inside.
- Without cgroups ("namespaces+rlimits") memory is capped per process by RLIMIT_AS and processes by
  RLIMIT_NPROC of the sandbox uid. Without namespaces ("rlimits-only", when not root) there is no
  network, PID or file-system isolation at all: only rlimits, a scrubbed environment, a private
  temporary work directory and process-group killing — do not run hostile code in that tier.
"""

from __future__ import annotations

import functools
import logging

from sandboxes.api import (
    Artifact,
    HarnessReport,
    Limits,
    SandboxResult,
    SandboxSpec,
    StatementOutcome,
    Status,
)
from sandboxes.pool import SandboxPool, run

__all__ = [
    "Artifact",
    "HarnessReport",
    "Limits",
    "SandboxPool",
    "SandboxResult",
    "SandboxSpec",
    "StatementOutcome",
    "Status",
    "probe_tier",
    "run",
]


@functools.cache
def probe_tier() -> str:
    """The isolation tier this machine gives: "namespaces+cgroup", "namespaces+rlimits" or "rlimits-only".

    Probed once per process by trying what a sandbox does (namespaces, read-only root, a cgroup).
    """
    from sandboxes._linux import decide_tier

    tier, _ = decide_tier()
    logging.getLogger("sandboxes").info("sandbox isolation tier: %s", tier)
    return tier
