"""The wire protocol between a sandbox's owner (``sandboxes.pool``, ``sandboxes.runner``) and its zygote.

Between two trusted processes over a SOCK_SEQPACKET socket: each packet is one ``marshal``-ed message of
plain values (no Python code runs to encode or decode it, unlike pickle), with file descriptors passed
alongside (SCM_RIGHTS).

Zygote → owner:
    {"ready": True, "tier", "pid", "uid", ...} once at start (or {"ready": False, "error"});
    {"standby": {"pid", "slot", "cgroup", "ident"}} with the standby's fds: a pre-forked sandbox waiting;
    {"exited": ident, "status", ...} when the zygote reaped a sandbox; {"remounted": ident}.
Owner → zygote:
    {"took": ident} (make another standby), {"release": ident} (clean its slot and cgroup once reaped),
    {"remount": ident, "size": n} (resize its tmpfs), {"quit": True}.
Owner → sandbox (its go pipe, fd 4): the job, ``JOB_LENGTH``-prefixed marshal bytes.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import select
import socket
import struct
from dataclasses import dataclass
from typing import Any

from sandboxes import _linux


def readable(fd: int, timeout: float | None = None) -> bool:
    """Whether ``fd`` is readable (a pidfd: its process has exited) within ``timeout`` seconds (None: wait).

    poll(2), never select(2): select fails on a descriptor above 1023 ("filedescriptor out of range"),
    which a worker holding a hundred sandbox sessions' pipes and sockets reaches."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))


JOB_LENGTH = struct.Struct(">Q")
"""The length prefix of a job written to a standby's go pipe."""
MAX_PACKET = 1 << 16


def send_packet(sock: socket.socket, obj: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
    """One message of plain values on a SOCK_SEQPACKET socket, with fds."""
    socket.send_fds(sock, [marshal.dumps(obj)], list(fds))


def recv_packet(sock: socket.socket) -> tuple[Any, list[int]]:
    """(message, fds); (None, []) when the peer closed the socket."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_PACKET, 16)
    if not data:
        return None, fds
    return marshal.loads(data), fds


@dataclass
class Standby:
    """A pre-forked sandbox process waiting for its job; used once."""

    pid: int  # in the zygote's PID namespace (PID 1 of its own)
    pidfd: int
    slot: str  # the slot's root as the zygote sees it (a tmpfs in the namespaced tiers)
    cgroup: _linux.CgroupSet | None
    go_w: int  # the job goes through this pipe
    stdin_fd: int
    out_r: int
    err_r: int
    rep_r: int
    ident: int

    @property
    def workdir(self) -> str:
        return os.path.join(self.slot, "work")

    def fds(self) -> list[int]:
        return [self.pidfd, self.go_w, self.stdin_fd, self.out_r, self.err_r, self.rep_r]

    def close_fds(self) -> None:
        for fd in self.fds():
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
