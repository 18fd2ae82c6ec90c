"""Thin ctypes wrappers over the Linux calls the sandbox needs (Python 3.11 has no os.unshare),
per-execution cgroups (v1 and v2), and the capability probe that decides the isolation tier.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
from dataclasses import dataclass

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 2

MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
SYS_MOUNT_SETATTR = 442  # x86_64 and aarch64 (the generic table) agree on this number

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
# The same library called with the GIL held (for fork: the child must find the interpreter as it was).
_pylibc = ctypes.PyDLL(ctypes.util.find_library("c") or None, use_errno=True)
_bare_fork = getattr(_pylibc, "_Fork", None)  # glibc >= 2.34


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
            None if data is None else data.encode(),
        ),
        f"mount {target}",
    )


def umount(target: str, flags: int = MNT_DETACH) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount {target}")


def mount_setattr(path: str, attr_set: int, attr_clr: int = 0, propagation: int = 0,
                  recursive: bool = True) -> None:
    """One call that changes a whole mount tree (Linux >= 5.12)."""
    attr = _MountAttr(attr_set, attr_clr, propagation, 0)
    _check(
        _libc.syscall(
            ctypes.c_long(SYS_MOUNT_SETATTR),
            ctypes.c_int(AT_FDCWD),
            path.encode(),
            ctypes.c_uint(AT_RECURSIVE if recursive else 0),
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
        ),
        f"mount_setattr {path}",
    )


def make_tree_readonly(path: str = "/") -> None:
    """Make every mount under `path` read-only, nosuid and private; falls back to per-mount remounts."""
    try:
        mount_setattr(path, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, propagation=MS_PRIVATE)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOSYS, errno.EINVAL, errno.EPERM):
            raise
    mount("none", path, None, MS_REC | MS_PRIVATE)
    targets = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            target = line.split()[4].encode().decode("unicode_escape")
            if target == path or target.startswith(path.rstrip("/") + "/"):
                targets.append(target)
    for target in targets:
        # A mount we cannot remount (e.g. locked flags) stays as it is; the sandbox uid still has no
        # write permission on root-owned files there.
        with contextlib.suppress(OSError):
            mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)


SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = 0o2000000
MOVE_MOUNT_F_EMPTY_PATH = 0x4


def open_tree_clone(path: str) -> int:
    """A detached copy of the mount tree at `path` (Linux >= 5.2), to be attached with move_mount_fd."""
    return _check(
        _libc.syscall(ctypes.c_long(SYS_OPEN_TREE), ctypes.c_int(AT_FDCWD), path.encode(),
                      ctypes.c_uint(OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE)),
        f"open_tree {path}",
    )


def move_mount_fd(fd: int, target: str) -> None:
    _check(
        _libc.syscall(ctypes.c_long(SYS_MOVE_MOUNT), ctypes.c_int(fd), b"", ctypes.c_int(AT_FDCWD),
                      target.encode(), ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)),
        f"move_mount {target}",
    )


def hidden_ancestor(path: str) -> str | None:
    """The first directory on the way to `path` that other users cannot traverse (e.g. /root), or None."""
    current = "/"
    for part in os.path.abspath(path).strip("/").split("/"):
        current = os.path.join(current, part)
        try:
            mode = os.stat(current).st_mode
        except OSError:
            return None
        if not mode & 0o001:
            return current
    return None


def expose_under_tmpfs(hidden: str, paths: list[str]) -> None:
    """Cover `hidden` with an empty world-traversable tmpfs and re-attach only `paths` inside it.

    Used when the interpreter lives in a private directory (pyenv under /root): the sandbox uid can then
    run and import it, and sees nothing else of that directory.
    """
    trees = [(path, open_tree_clone(path)) for path in paths]
    mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
    for path, fd in trees:
        os.makedirs(path, exist_ok=True)
        move_mount_fd(fd, path)
        os.close(fd)


def fork_without_handlers() -> int:
    """fork(2) without the at-fork handlers: glibc's and Python's (`os.register_at_fork`: threading,
    random, logging, ...), and without Python's after-fork re-initialisation of its thread tables.

    Those exist for a parent with other threads; in a single-threaded one they only re-create locks and
    tables, and in the child that costs ~200 copied pages (~0.7 ms) per fork. Only for a caller that has
    no other thread (the zygote checks); the child must re-seed `random` itself. Falls back to os.fork() where libc has no
    `_Fork` (glibc < 2.34, musl).
    """
    if _bare_fork is None:
        return os.fork()
    pid = _bare_fork()
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fork: {os.strerror(err)}")
    return int(pid)


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(_libc.sethostname(raw, ctypes.c_size_t(len(raw))), "sethostname")


def prctl(option: int, arg2: int) -> None:
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(0), ctypes.c_ulong(0),
                       ctypes.c_ulong(0)), "prctl")


# ---------------------------------------------------------------- cgroups

CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass
class CgroupSet:
    """The per-execution cgroup directories (one for v2, one per controller for v1).

    A v1 set is recycled by its zygote for a later execution once it is verified empty (see `recycle`);
    counters that cannot be reset are judged against the value they had when it was handed out.
    """

    version: int
    dirs: dict[str, str]  # controller ("unified" for v2) -> directory
    oom_kills_before: int = 0  # the OOM-kill counter when this execution got the set

    def to_wire(self) -> tuple[int, dict[str, str], int]:
        return self.version, self.dirs, self.oom_kills_before

    @classmethod
    def from_wire(cls, wire: tuple[int, dict[str, str], int]) -> CgroupSet:
        return cls(wire[0], dict(wire[1]), wire[2])

    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in dict.fromkeys(self.dirs.values())]

    def configure(self, memory_bytes: int, max_processes: int) -> None:
        if self.version == 2:
            d = self.dirs["unified"]
            _write(os.path.join(d, "memory.max"), str(memory_bytes))
            _write_optional(os.path.join(d, "memory.swap.max"), "0")
            _write(os.path.join(d, "pids.max"), str(max_processes))
            return
        mem = self.dirs["memory"]
        # memory+swap must stay >= memory at every step: raise it first when growing (the first write fails,
        # harmlessly, when shrinking), lower it last when shrinking.
        memsw = os.path.join(mem, "memory.memsw.limit_in_bytes")
        _write_optional(memsw, str(memory_bytes))
        _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
        _write_optional(memsw, str(memory_bytes))
        _write(os.path.join(self.dirs["pids"], "pids.max"), str(max_processes))

    def reset_peak(self) -> None:
        """Forget the standby's own set-up in the peak (v1 only; v2 keeps memory.peak)."""
        if self.version == 1:
            _write_optional(os.path.join(self.dirs["memory"], "memory.max_usage_in_bytes"), "0")

    def cpu_seconds(self) -> float | None:
        """CPU time used by everything that ever ran in the cgroup."""
        if self.version == 2:
            usec = _read_kv(os.path.join(self.dirs["unified"], "cpu.stat")).get("usage_usec")
            return None if usec is None else usec / 1e6
        if "cpuacct" not in self.dirs:
            return None
        ns = _read_int(os.path.join(self.dirs["cpuacct"], "cpuacct.usage"))
        return None if ns is None else ns / 1e9

    def peak_memory(self) -> int | None:
        if self.version == 2:
            return _read_int(os.path.join(self.dirs["unified"], "memory.peak"))
        return _read_int(os.path.join(self.dirs["memory"], "memory.max_usage_in_bytes"))

    def oom_killed(self) -> bool:
        if self.version == 2:
            events = _read_kv(os.path.join(self.dirs["unified"], "memory.events"))
            return events.get("oom_kill", 0) > 0 or (events.get("max", 0) > 0 and events.get("oom", 0) > 0)
        control = _read_kv(os.path.join(self.dirs["memory"], "memory.oom_control"))
        if control.get("oom_kill", 0) > self.oom_kills_before:
            return True
        return (_read_int(os.path.join(self.dirs["memory"], "memory.failcnt")) or 0) > 0 and bool(
            control.get("under_oom", 0))

    def recycle(self, memory_bytes: int, max_processes: int, max_leftover_bytes: int = 16 << 20) -> bool:
        """Make this (v1) set ready for another execution: True when it is empty, holds little leftover
        memory (page cache and kernel objects charged by the last execution) and has its limits and
        counters reset; False when it should be removed instead. v2 sets are never recycled (memory.peak
        cannot be reset on every kernel)."""
        if self.version != 1 or any(_read_text(procs).strip() for procs in self.procs_files()):
            return False
        mem = self.dirs["memory"]
        usage = _read_int(os.path.join(mem, "memory.usage_in_bytes"))
        if usage is None or usage > max_leftover_bytes:
            return False
        try:
            self.configure(memory_bytes, max_processes)
            _write(os.path.join(mem, "memory.failcnt"), "0")
            _write_optional(os.path.join(mem, "memory.memsw.failcnt"), "0")
            if "cpuacct" in self.dirs:
                _write_optional(os.path.join(self.dirs["cpuacct"], "cpuacct.usage"), "0")
        except OSError:
            return False
        self.oom_kills_before = _read_kv(os.path.join(mem, "memory.oom_control")).get("oom_kill", 0)
        return True

    def remove(self) -> None:
        for d in dict.fromkeys(self.dirs.values()):
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        break
                    # The last killed process is still being torn down by the kernel.
                    import time

                    time.sleep(0.002)


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)  # raw fds: no Python file objects in the zygote's hot loop
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read_text(path: str) -> str:
    """A small kernel file's content ("" when unreadable), through a raw fd (no Python file object)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return ""
    try:
        return os.read(fd, 1 << 16).decode()
    except OSError:
        return ""
    finally:
        os.close(fd)


def _write_optional(path: str, value: str) -> None:
    with contextlib.suppress(OSError):
        _write(path, value)


def _read_int(path: str) -> int | None:
    try:
        return int(_read_text(path).split()[0])
    except (ValueError, IndexError):
        return None


def _read_kv(path: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in _read_text(path).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _own_cgroup_paths() -> dict[str, str]:
    """controller -> our cgroup path, from /proc/self/cgroup ("unified" for the v2 line)."""
    out: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers == "":
                out["unified"] = path
            for c in controllers.split(","):
                if c:
                    out[c] = path
    return out


class CgroupFactory:
    """Creates per-execution cgroups under a parent the probe found writable, or is `None`."""

    def __init__(self, version: int, parents: dict[str, str]) -> None:
        self.version = version
        self.parents = parents
        self._counter = 0

    def create(self, memory_bytes: int, max_processes: int) -> CgroupSet:
        self._counter += 1
        name = f"run-{os.getpid()}-{self._counter}"
        dirs = {}
        try:
            for controller, parent in self.parents.items():
                d = os.path.join(parent, name)
                os.mkdir(d)
                dirs[controller] = d
            cgroup = CgroupSet(self.version, dirs)
            cgroup.configure(memory_bytes, max_processes)
        except BaseException:
            CgroupSet(self.version, dirs).remove()
            raise
        return cgroup

    @staticmethod
    def discover() -> CgroupFactory | None:
        """Find (and create) a writable `temper-sandbox` parent for memory and pids, v2 first."""
        try:
            own = _own_cgroup_paths()
        except OSError:
            return None
        v2_root = CGROUP_ROOT if os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")) else None
        if v2_root is not None and "unified" in own:
            parent = _ensure_v2_parent(v2_root + own["unified"])
            if parent is not None:
                return CgroupFactory(2, {"unified": parent})
        parents = {}
        for controller in ("memory", "pids"):
            mount_dir = os.path.join(CGROUP_ROOT, controller)
            if controller not in own or not os.path.exists(os.path.join(mount_dir, "cgroup.procs")):
                return None
            parent = os.path.join(mount_dir + own[controller], "temper-sandbox")
            try:
                os.makedirs(parent, exist_ok=True)
            except OSError:
                return None
            if not os.access(parent, os.W_OK):
                return None
            parents[controller] = parent
        # CPU accounting is a bonus (exact CPU time of killed trees), not a requirement.
        acct_mount = os.path.join(CGROUP_ROOT, "cpuacct")
        if "cpuacct" in own and os.path.exists(os.path.join(acct_mount, "cpuacct.usage")):
            parent = os.path.join(acct_mount + own["cpuacct"], "temper-sandbox")
            try:
                os.makedirs(parent, exist_ok=True)
                parents["cpuacct"] = parent
            except OSError:
                pass
        return CgroupFactory(1, parents)

    def sweep_stale(self) -> None:
        """Remove the empty per-execution cgroups of zygotes that are gone (killed before cleaning up)."""
        for parent in self.parents.values():
            try:
                names = os.listdir(parent)
            except OSError:
                continue
            for name in names:
                parts = name.split("-")
                if len(parts) != 3 or parts[0] != "run" or not parts[1].isdigit():
                    continue
                try:
                    os.kill(int(parts[1]), 0)
                    continue  # its zygote (or a process that reused the pid) is alive: not ours to judge
                except ProcessLookupError:
                    pass
                except OSError:
                    continue
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(parent, name))  # fails (EBUSY) unless empty

    def works(self) -> bool:
        """Create, configure and remove one cgroup: the probe proper."""
        try:
            self.create(64 << 20, 8).remove()
            return True
        except OSError:
            return False


def _ensure_v2_parent(own_dir: str) -> str | None:
    """A v2 parent with memory and pids delegated to its children, or None."""
    parent = os.path.join(own_dir, "temper-sandbox")
    try:
        os.makedirs(parent, exist_ok=True)
        with open(os.path.join(parent, "cgroup.controllers")) as f:
            available = set(f.read().split())
        if not {"memory", "pids"} <= available:
            return None
        _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
        return parent
    except OSError:
        return None


# ---------------------------------------------------------------- the probe

TIER_FULL = "namespaces+cgroup"
TIER_NAMESPACES = "namespaces+rlimits"
TIER_RLIMITS = "rlimits-only"


def namespaces_work() -> bool:
    """Fork a child that tries exactly what a sandbox does: new namespaces, read-only root, fresh /proc."""
    if os.geteuid() != 0:
        return False
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            unshare(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
            make_tree_readonly("/")
            inner = os.fork()
            if inner == 0:
                try:
                    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m")
                    os._exit(0 if os.getpid() == 1 else 1)
                except BaseException:
                    os._exit(1)
            _, status = os.waitpid(inner, 0)
            code = os.waitstatus_to_exitcode(status)
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def decide_tier() -> tuple[str, CgroupFactory | None]:
    """Run the capability probe: namespaces and a writable cgroup, or the weaker tiers."""
    if not namespaces_work():
        return TIER_RLIMITS, None
    factory = CgroupFactory.discover()
    if factory is not None and factory.works():
        return TIER_FULL, factory
    return TIER_NAMESPACES, None
