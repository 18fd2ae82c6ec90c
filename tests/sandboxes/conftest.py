"""Shared fixtures: one warm pool for the whole sandbox suite, and the stray-process check."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from sandboxes import SandboxPool
from sandboxes.zygote import UID_BASE

_watched_uids: set[int] = set()
_zygote_pids: set[int] = set()


def sandbox_processes() -> list[tuple[int, int, str]]:
    """(pid, parent pid, name) of every process running as one of our pools' sandbox uids.

    (Other engineers' pools on the same machine use other uids and are left out.)
    """
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        uid = int(status.get("Uid", "0").split()[0])
        if uid not in _watched_uids or status.get("State", "").strip().startswith("Z"):
            continue
        found.append((int(entry), int(status.get("PPid", "0")), status.get("Name", "").strip()))
    return found


def watch(pool: SandboxPool) -> SandboxPool:
    """Include this pool's sandbox uids in the stray-process checks."""
    _watched_uids.update(UID_BASE + pid for pid in pool.zygote_pids)
    _zygote_pids.update(pool.zygote_pids)
    return pool


def strays(timeout: float = 0.0) -> list[tuple[int, int, str]]:
    """Sandbox processes other than the standbys waiting for a job (the zygotes' own children).

    With `timeout`, keep looking until none is left or the time is up (for the asynchronous teardown
    after a kill).
    """
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in sandbox_processes() if p[1] not in _zygote_pids]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


_pools: list[SandboxPool] = []


@pytest.fixture(scope="session")
def pool() -> Iterator[SandboxPool]:
    with SandboxPool(size=2) as p:
        _pools.append(p)
        yield watch(p)
    from sandboxes.pool import _close_all

    _close_all()  # the default pool (used by some tests) too
    # After the pool is closed nothing of it may be left: no zygote, no standby, no sandbox process.
    deadline = time.monotonic() + 5
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []


@pytest.fixture(autouse=True)
def no_stray_processes() -> Iterator[None]:
    yield
    for p in list(_pools):
        watch(p)
    # An execution returns only once its PID namespace is gone, so nothing should be left at all; the
    # small allowance only covers the kernel finishing a teardown on a heavily loaded machine.
    assert strays(timeout=2.0) == []
