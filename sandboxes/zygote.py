"""The zygote: a warm, pre-started interpreter that keeps pre-forked sandboxes ready for its owner.

Started by `SandboxPool` as `python -I -c ... sandboxes.zygote` with an already scrubbed environment, it
preloads modules, runs the capability probe, enters a private mount namespace, freezes its heap (so
children copy fewer pages) and then keeps `standbys` sandboxes handed out ahead to its owner over a
SOCK_SEQPACKET socket (their fds passed with SCM_RIGHTS). Making one:

  slot      a fresh tmpfs (size: the disk limit) holding the work directory (root, sticky 1777) — later
            also the code and the inputs — and a cgroup (memory, pids, cpuacct): a new one, or one
            recycled from a reaped sandbox once verified empty, limits and counters reset;
  fork      the sandbox process, PID 1 of a new PID namespace (unshare(CLONE_NEWPID) before the fork,
            setns back after; forked without at-fork handlers, see `_linux.fork_without_handlers`).
            At nice 19 (the owner renices it when it hands it a job) it joins the
            cgroup, enters a network namespace of the zygote's own (made once, reused only after its
            last sandbox is gone: see `Zygote._new_netns`), unshares mount, IPC and UTS namespaces, puts its slot alone on /tmp (a
            directory the sandbox uid cannot enter but the interpreter lives in, pyenv under /root, is
            already covered in the zygote's mount namespace by a tmpfs that re-exposes only the
            interpreter), makes the whole mount tree
            read-only/nosuid/private, re-allows writes on /tmp (noexec), mounts a fresh /proc, scrubs the
            environment, drops to a per-zygote unmapped uid with no groups, no_new_privs and
            non-dumpable, keeps only fds 0-4, sets up the harness and waits for its job on fd 4.

The owner (`sandboxes.runner`) writes the inputs, sends the job, supervises and judges. The zygote, the
sandbox's parent, reaps it and reports how it ended ({"exited": id, ...}), and when the owner releases
it removes its slot and cgroup. The zygote exits, killing every sandbox it made, when its owner goes
away (quit message, socket EOF or reparenting).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import marshal
import math
import os
import resource
import select
import signal
import socket
import sys

from sandboxes import _linux
from sandboxes.api import Limits
from sandboxes.harness import (
    REPORT_FD,
    Job,
    decode_frames,
    encode_frame,
    load_epilogue,
    run_harness,
)
from sandboxes.protocol import JOB_LENGTH, recv_packet, send_packet

# Imported here so that executions find them already loaded (the point of a warm interpreter).
PRELOAD = (
    "abc", "argparse", "array", "base64", "bisect", "calendar", "collections", "copy", "csv", "dataclasses",
    "datetime", "decimal", "enum", "fractions", "functools", "heapq", "io", "itertools", "json", "math",
    "operator", "random", "re", "statistics", "string", "textwrap", "typing", "unittest", "uuid",
)

SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "USER": "sandbox",
    "LOGNAME": "sandbox",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
    # Numerical libraries (OpenBLAS, OpenMP, MKL) start a thread per core at import: in a zygote that
    # preloads numpy they would make every fork a fork of a multi-threaded process, and in a sandbox they
    # would count against its process limit. One thread each.
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
SANDBOX_ROOT = "/tmp"  # in the namespaced tiers: a fresh tmpfs per execution
UID_BASE = 1_000_000  # sandbox uid = UID_BASE + zygote pid: unmapped, unique among live zygotes
MAX_ARTIFACTS = 100
MAX_ARTIFACT_BYTES = 8 << 20
MAX_ARTIFACTS_TOTAL = 32 << 20
STANDBY_NICE = 19
SPARE_CGROUPS = 4
SPARE_NETNS = 4
F_SETPIPE_SZ = 1031
REPORT_PIPE_BYTES = 1 << 20
GO_FD = 4  # D reads its job here; closed before the untrusted code runs
DEFAULT_LIMITS = Limits()
DEFAULT_DISK = DEFAULT_LIMITS.disk_bytes

class Zygote:
    """Makes the standbys, reaps them and cleans up after them, ahead of and behind the owner's requests:
    the forking, mounting, cgroup making, reaping and cleaning happen here, in the background, so none of
    it sits between a job and its verdict.
    """

    def __init__(self, sock: socket.socket | None, owner_pid: int, forced_tier: str | None,
                 standbys: int = 2) -> None:
        self.sock = sock
        self.owner_pid = owner_pid
        tier, cgroups = _linux.decide_tier()
        if forced_tier is not None and _TIER_ORDER.index(forced_tier) > _TIER_ORDER.index(tier):
            tier = forced_tier  # only ever weaker than what the machine gives (tests use this)
            cgroups = cgroups if tier == _linux.TIER_FULL else None
        self.tier = tier
        self.cgroups = cgroups
        if cgroups is not None:
            cgroups.sweep_stale()
        self.spare_cgroups: list[_linux.CgroupSet] = []  # emptied, reset and ready for another execution
        # Network namespaces are made once and reused (see _new_netns): fds of the idle ones, and of those
        # lent to a standby, by its ident.
        self.spare_netns: list[int] = []
        self.lent_netns: dict[int, int] = {}
        self.host_netns_fd = -1
        self.namespaces = tier != _linux.TIER_RLIMITS
        self.drop_privileges = os.geteuid() == 0
        self.uid = UID_BASE + os.getpid() if self.drop_privileges else os.getuid()
        self.pidns_fd = -1
        self.standby_target = standbys
        self.counter = 0
        # Started with exactly the sandbox's environment (see the pool): then a sandbox need not rebuild it.
        self.env_is_sandbox_env = dict(os.environ) == SANDBOX_ENV
        # No other thread (at the C level either): forks may skip the at-fork handlers (see _linux).
        self.single_threaded = len(os.listdir("/proc/self/task")) == 1
        self.expose: dict[str, list[str]] = {}  # hidden directory -> the trees each sandbox re-attaches
        # Resolved before /tmp is covered below: a virtualenv there would no longer resolve to its interpreter.
        self.real_executable = os.path.realpath(sys.executable)
        if self.namespaces:
            # Our own mount namespace: the per-execution tmpfs mounts never show up on the host, and a
            # small tmpfs on /tmp holds the slots' mount points.
            _linux.unshare(_linux.CLONE_NEWNS)
            _linux.mount("none", "/", None, _linux.MS_REC | _linux.MS_PRIVATE)
            _linux.mount("tmpfs", SANDBOX_ROOT, "tmpfs", _linux.MS_NOSUID | _linux.MS_NODEV, "size=1m,mode=711")
            self.slots_base = SANDBOX_ROOT
            self.pidns_fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            self.host_netns_fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            # The interpreter may live where the sandbox uid cannot go (pyenv under /root, 0700): such a
            # directory is covered by a tmpfs that re-attaches only the interpreter's own trees — once, here
            # in our mount namespace (which every sandbox copies), unless this process still needs more of
            # it (its own code under /root): then in each sandbox.
            for path in dict.fromkeys(os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.executable)):
                hidden = _linux.hidden_ancestor(path)
                if hidden is not None:
                    tree = path if os.path.isdir(path) else os.path.dirname(path)
                    trees = self.expose.setdefault(hidden, [])
                    if not any(tree == t or tree.startswith(t + "/") for t in trees):
                        trees.append(tree)
            needed = [os.path.realpath(p) for p in sys.path if p]
            if not any(_covered(p, hidden, trees) for p in needed for hidden, trees in self.expose.items()):
                for hidden, trees in self.expose.items():
                    _linux.expose_under_tmpfs(hidden, trees)
                self.expose = {}
        else:
            import tempfile

            self.slots_base = tempfile.mkdtemp(prefix="temper-sandbox-")
            os.chmod(self.slots_base, 0o711)
        # Warm the crypto path once here rather than in every child (OpenSSL caches the digest on first
        # use: done here, every sandbox shares the page instead of writing its own copy).
        decode_frames(b"k" * 32, encode_frame(b"k" * 32, 0, {"k": "warm-up"}))
        gc.collect()
        gc.freeze()  # children then do not write to (and copy) the pages of every preloaded object

    # ------------------------------------------------------------ the loop: make standbys, clean up after them

    def serve(self) -> None:
        """Keep `standby_target` standbys handed out ahead; reap and clean the used ones.

        Messages from the owner: {"took": id} (a standby was taken: make another), {"release": id} (the
        owner is done with it: clean its slot and cgroup once its init is reaped), {"remount": id,
        "size": n} (resize its tmpfs; answered with {"remounted": id}), {"quit": True}.
        """
        assert self.sock is not None
        sock = self.sock
        send_packet(sock, {"ready": True, "tier": self.tier, "pid": os.getpid(), "uid": self.uid,
                           "namespaces": self.namespaces, "drop_privileges": self.drop_privileges})
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the poll below through the wake-up fd
        children: dict[int, tuple[int, str, _linux.CgroupSet | None]] = {}  # pid -> ident, slot, cgroup
        slots: dict[int, str] = {}
        reaped: dict[int, tuple[str, _linux.CgroupSet | None]] = {}
        released: set[int] = set()
        outstanding = 0
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        try:
            while self._owner_alive():
                while outstanding < self.standby_target:
                    pid, ident, slot, cgroup, fds = self._make_standby()
                    children[pid] = (ident, slot, cgroup)
                    slots[ident] = slot
                    try:
                        send_packet(sock, {"standby": {"pid": pid, "slot": slot,
                                                       "cgroup": None if cgroup is None else cgroup.to_wire(),
                                                       "ident": ident}}, fds)
                    finally:
                        for fd in fds:
                            os.close(fd)
                    outstanding += 1
                ready = {fd for fd, _ in poller.poll(1000)}  # poll, not select: no limit on descriptor numbers
                if wake_r in ready:
                    with contextlib.suppress(OSError):
                        os.read(wake_r, 4096)
                if sock.fileno() in ready:
                    message, _ = recv_packet(sock)  # OSError (owner gone) ends the loop below
                    if message is None or message.get("quit"):
                        return
                    if "took" in message:
                        outstanding -= 1
                    if "release" in message:
                        released.add(message["release"])
                    if "remount" in message:
                        _linux.mount("tmpfs", slots[message["remount"]], None,
                                     _linux.MS_REMOUNT | _linux.MS_NOSUID | _linux.MS_NODEV,
                                     f"size={int(message['size'])}")
                        send_packet(sock, {"remounted": message["remount"]})
                while children:  # reap what has ended, and tell the owner how it ended
                    try:
                        pid, status, usage = os.wait4(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    entry = children.pop(pid, None)
                    if entry is not None:
                        reaped[entry[0]] = (entry[1], entry[2])
                        send_packet(sock, {"exited": entry[0], "status": status,
                                           "cpu": usage.ru_utime + usage.ru_stime, "maxrss": usage.ru_maxrss})
                for ident in [i for i in released if i in reaped]:
                    slot, cgroup = reaped.pop(ident)
                    released.discard(ident)
                    slots.pop(ident, None)
                    self._cleanup_slot(ident, slot, cgroup, recycle=True)
        except OSError:
            pass  # the owner closed the socket: same as quitting
        finally:
            # Owner gone or quitting: kill every sandbox (in flight or waiting) and clean up.
            for pid, (ident, slot, cgroup) in children.items():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
                self._cleanup_slot(ident, slot, cgroup)
            for ident, (slot, cgroup) in reaped.items():
                self._cleanup_slot(ident, slot, cgroup)
            for cgroup in self.spare_cgroups:
                cgroup.remove()
            for fd in self.spare_netns:
                os.close(fd)
            if not self.namespaces:
                import shutil

                shutil.rmtree(self.slots_base, ignore_errors=True)

    def _owner_alive(self) -> bool:
        return os.getppid() == self.owner_pid

    # ------------------------------------------------------------ preparing a standby

    def _make_standby(self) -> tuple[int, int, str, _linux.CgroupSet | None, list[int]]:
        self.counter += 1
        slot = os.path.join(self.slots_base, f"slot-{self.counter}")
        os.mkdir(slot, 0o1777)
        if self.namespaces:
            _linux.mount("tmpfs", slot, "tmpfs", _linux.MS_NOSUID | _linux.MS_NODEV,
                         f"size={DEFAULT_DISK},mode=1777,nr_inodes=16384")
        os.chmod(slot, 0o1777)
        workdir = os.path.join(slot, "work")
        os.mkdir(workdir)
        os.chmod(workdir, 0o1777)  # sticky: the code cannot delete or rename root's read-only inputs
        cgroup = None
        try:
            if self.spare_cgroups:
                cgroup = self.spare_cgroups.pop()
            elif self.cgroups is not None:
                cgroup = self.cgroups.create(DEFAULT_LIMITS.memory_bytes, DEFAULT_LIMITS.max_processes)
            go_r, go_w = os.pipe()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            rep_r, rep_w = os.pipe()
            with contextlib.suppress(OSError):
                fcntl.fcntl(rep_w, F_SETPIPE_SZ, REPORT_PIPE_BYTES)
            stdin_fd = os.memfd_create("stdin", 0)
            child_fds = (stdin_fd, out_w, err_w, rep_w, go_r)
            keep = (go_w, out_r, err_r, rep_r)
            netns = -1
            if self.namespaces:
                netns = self.spare_netns.pop() if self.spare_netns else self._new_netns()
                self.lent_netns[self.counter] = netns
                _linux.unshare(_linux.CLONE_NEWPID)  # applies to our next child only
            try:
                pid = _linux.fork_without_handlers() if self.single_threaded else os.fork()
            except BaseException:
                if self.namespaces:
                    _linux.setns(self.pidns_fd, _linux.CLONE_NEWPID)
                raise
            if pid == 0:
                try:
                    if self.single_threaded and "random" in sys.modules:
                        sys.modules["random"].seed()  # what its at-fork handler does: no shared sequence
                    for fd in keep:
                        os.close(fd)
                    self._sandbox_process(slot, cgroup, child_fds, netns)
                finally:
                    os._exit(125)  # never return into the forker's loop
            if self.namespaces:
                _linux.setns(self.pidns_fd, _linux.CLONE_NEWPID)  # our own namespace again for children
        except BaseException:
            if cgroup is not None:
                cgroup.remove()
            self._return_netns(self.counter, recycle=False)
            raise
        for fd in (out_w, err_w, rep_w, go_r):  # the child's ends (stdin_fd is shared: we write it)
            os.close(fd)
        for fd in (out_r, err_r, rep_r):
            os.set_blocking(fd, False)
        return pid, self.counter, slot, cgroup, [os.pidfd_open(pid), go_w, stdin_fd, out_r, err_r, rep_r]

    def _new_netns(self) -> int:
        """A new, empty network namespace (only ``lo``, down), held by the fd returned.

        Made here and reused by later sandboxes instead of one unshare(CLONE_NEWNET) per execution: making
        and tearing down a network namespace is the dearest part of a sandbox (~0.8 ms of kernel CPU per
        execution, measured with bench/verifiers.py). Reuse leaks nothing between executions: a namespace
        goes back to the spares only once its sandbox's PID namespace is gone (every process, so every
        socket, closed), and the sandbox uid holds no capability in it, so it can neither bring ``lo``
        up nor change routes, rules or sysctls — what the next sandbox finds is what a fresh one has.
        Two sandboxes never share one at the same time.
        """
        _linux.unshare(_linux.CLONE_NEWNET)
        try:
            return os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            _linux.setns(self.host_netns_fd, _linux.CLONE_NEWNET)

    def _return_netns(self, ident: int, recycle: bool) -> None:
        fd = self.lent_netns.pop(ident, -1)
        if fd < 0:
            return
        if recycle and len(self.spare_netns) < SPARE_NETNS:
            self.spare_netns.append(fd)
        else:
            os.close(fd)

    def _cleanup_slot(self, ident: int, slot: str, cgroup: _linux.CgroupSet | None, recycle: bool = False
                      ) -> None:
        """Unmount and remove a slot whose sandbox has been reaped (its namespace is empty); recycle its
        cgroup and network namespace for a later execution when it can be (saves a mkdir and rmdir per
        controller, and a namespace's making and teardown), else remove them."""
        self._return_netns(ident, recycle)
        if self.namespaces:
            with contextlib.suppress(OSError):
                _linux.umount(slot)
            with contextlib.suppress(OSError):
                os.rmdir(slot)
        else:
            import shutil

            shutil.rmtree(slot, ignore_errors=True)
        if cgroup is not None:
            if recycle and len(self.spare_cgroups) < SPARE_CGROUPS and cgroup.recycle(
                    DEFAULT_LIMITS.memory_bytes, DEFAULT_LIMITS.max_processes):
                self.spare_cgroups.append(cgroup)
            else:
                cgroup.remove()

    # ------------------------------------------------------------ inside the sandbox

    def _sandbox_process(self, slot: str, cgroup: _linux.CgroupSet | None, fds: tuple[int, int, int, int, int],
                         netns: int) -> None:
        """The sandbox: PID 1 of its namespaces. Isolates itself, drops privileges, waits for its job, runs
        the harness and the untrusted code. Never returns.

        Being the namespace's init, its exit makes the kernel kill everything left in the namespace, and
        signals it sends itself with the default action are ignored (the kernel's own signals — the hard
        CPU limit's SIGKILL, a segfault — still kill it).
        """
        # Get ready at the lowest priority, so that preparing the next sandbox never slows the one running:
        # the owner raises us back to normal when it hands us a job.
        os.setpriority(os.PRIO_PROCESS, 0, STANDBY_NICE)
        os.setsid()
        _linux.prctl(_linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        if cgroup is not None:
            for procs in cgroup.procs_files():  # raw fds: every Python object touched here is a copied page
                fd = os.open(procs, os.O_WRONLY)
                try:
                    os.write(fd, b"0")
                finally:
                    os.close(fd)
        root = slot
        if self.namespaces:
            _linux.setns(netns, _linux.CLONE_NEWNET)  # an empty one of the zygote's, ours alone (_new_netns)
            _linux.unshare(_linux.CLONE_NEWNS | _linux.CLONE_NEWIPC | _linux.CLONE_NEWUTS)
            _linux.mount(slot, SANDBOX_ROOT, None, _linux.MS_BIND)  # our slot, alone, on /tmp
            for hidden, trees in self.expose.items():
                _linux.expose_under_tmpfs(hidden, trees)
            _linux.make_tree_readonly("/")
            _linux.mount_setattr(SANDBOX_ROOT, _linux.MOUNT_ATTR_NOEXEC | _linux.MOUNT_ATTR_NOSUID
                                 | _linux.MOUNT_ATTR_NODEV, attr_clr=_linux.MOUNT_ATTR_RDONLY, recursive=False)
            _linux.mount("proc", "/proc", "proc", _linux.MS_NOSUID | _linux.MS_NODEV | _linux.MS_NOEXEC)
            _linux.sethostname("sandbox")
            root = SANDBOX_ROOT
            if sys.executable.startswith(SANDBOX_ROOT + "/"):
                # A virtualenv under /tmp (a CI checkout, say) is covered by the work directory: point
                # sys.executable at the real interpreter, which stays visible, so code can still spawn Python.
                sys.executable = self.real_executable

        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 200) for fd in fds]
        for target, fd in enumerate(high):
            os.dup2(fd, target, inheritable=True)
        go_fd = GO_FD
        os.closerange(GO_FD + 1, 1 << 16)
        os.set_inheritable(REPORT_FD, False)  # the command must not get the report channel
        os.set_inheritable(go_fd, False)
        for sig in (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM, signal.SIGXCPU, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        workdir = os.path.join(root, "work")
        os.chdir(workdir)
        if not self.env_is_sandbox_env:
            os.environ.clear()
            os.environ.update(SANDBOX_ENV)
        if not self.namespaces:
            os.environ["HOME"] = os.environ["TMPDIR"] = root
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if self.drop_privileges:
            os.setgroups([])
            os.setresgid(self.uid, self.uid, self.uid)
            os.setresuid(self.uid, self.uid, self.uid)
        _linux.prctl(_linux.PR_SET_NO_NEW_PRIVS, 1)
        _linux.prctl(_linux.PR_SET_DUMPABLE, 0)
        sys.path[0:0] = [workdir]

        cgroups = self.cgroups

        def receive_job() -> Job:
            """Block until the owner sends the job (it is the only writer of this pipe); set its limits."""
            header = _read_exact(go_fd, JOB_LENGTH.size)
            if header is None:
                os._exit(0)  # discarded without a job
            # Plain values, marshalled by the owner (trusted): no Python code runs to load them.
            job = marshal.loads(_read_exact(go_fd, JOB_LENGTH.unpack(header)[0]) or b"")
            code, code_path, epilogue, command, key, limits = job[:6]
            session = len(job) > 6 and bool(job[6])
            next_cell = None
            if session:
                # The go pipe stays open: the session's cells come through it, each JOB_LENGTH-prefixed
                # marshal of a str. Read with C-level calls bound now (the cells' code can patch modules).
                _read, _unpack, _loads, _size = os.read, JOB_LENGTH.unpack, marshal.loads, JOB_LENGTH.size
                _len, _type, _str, _interrupt = len, type, str, KeyboardInterrupt

                def read_exact(n: int) -> bytes | None:
                    data = b""
                    while _len(data) < n:
                        try:
                            chunk = _read(go_fd, n - _len(data))
                        except _interrupt:  # a late SIGINT, meant for the cell before: nothing was read
                            continue
                        if not chunk:
                            return None
                        data += chunk
                    return data

                def next_cell() -> str | None:
                    head = read_exact(_size)
                    if head is None:
                        return None
                    body = read_exact(_unpack(head)[0])
                    cell = None if body is None else _loads(body)
                    return cell if _type(cell) is _str else None

                # The owner interrupts a cell at its time limit with SIGINT: as the namespace's init this
                # process receives only signals it handles (the cell may undo this; then it is killed).
                signal.signal(signal.SIGINT, signal.default_int_handler)
            else:
                os.close(go_fd)
            cpu_seconds, max_file_bytes, max_open_files, max_processes, memory_bytes = limits
            # Lowering limits needs no privilege, so they are set after the drop, per job. RLIMIT_CPU counts
            # from the process start: add what the set-up already used. Soft = hard: as init we would ignore
            # the soft limit's SIGXCPU; the hard limit's SIGKILL comes from the kernel and always kills.
            usage = resource.getrusage(resource.RUSAGE_SELF)
            cpu = max(1, math.ceil(usage.ru_utime + usage.ru_stime + cpu_seconds))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
            resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
            resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, max_open_files))
            if cgroups is None:
                # Without a cgroup: per-uid process count (the zygote's waiting standbys share the uid and
                # count too) and per-process address space.
                resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))
                resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
            return Job(code, code_path, load_epilogue(epilogue), command, key, next_cell)

        run_harness(receive_job)  # gets ready, then waits for the job


_TIER_ORDER = [_linux.TIER_FULL, _linux.TIER_NAMESPACES, _linux.TIER_RLIMITS]


def _covered(path: str, hidden: str, trees: list[str]) -> bool:
    """Whether covering `hidden` (re-attaching only `trees`) hides `path`."""
    inside = path == hidden or path.startswith(hidden.rstrip("/") + "/")
    return inside and not any(path == t or path.startswith(t + "/") for t in trees)


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        try:
            chunk = os.read(fd, n)
        except InterruptedError:
            continue
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)



def standard_library_only(keep: str) -> None:
    """Drop every site-packages directory (and what .pth files added) from ``sys.path``: the default runtime
    is the interpreter and its standard library, whatever the worker or the interpreter has installed."""
    base = os.path.realpath(sys.base_prefix)
    sys.path[:] = [p for p in sys.path if p == keep or (
        os.path.realpath(p or ".").startswith(base + os.sep)
        and "site-packages" not in p and "dist-packages" not in p)]


def main() -> None:
    """Entry point: `python -I -c "...; main()" OWNER_PID SOCKET_FD [FORCED_TIER [PRELOAD [STDLIB_ONLY]]]`.

    PRELOAD: the runtime's own modules (comma-separated) imported before the first fork; a runtime
    module that fails to import fails the start (a broken image), unlike the standard ones of `PRELOAD`.
    STDLIB_ONLY ("1"): the default runtime, see `standard_library_only`."""
    owner_pid, sock_fd = int(sys.argv[1]), int(sys.argv[2])
    forced = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None
    runtime_preload = [m for m in (sys.argv[4] if len(sys.argv) > 4 else "").split(",") if m]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET, fileno=sock_fd)
    if len(sys.argv) > 5 and sys.argv[5] == "1":
        standard_library_only(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            __import__(name)
    try:
        for name in runtime_preload:
            __import__(name)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            send_packet(sock, {"ready": False, "error": f"preloading {name} failed: {exc!r}"[:2000]})
        return
    if os.getppid() != owner_pid:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal reaches the owner, which closes us
    try:
        zygote = Zygote(sock, owner_pid, forced)
    except Exception as exc:
        with contextlib.suppress(OSError):
            send_packet(sock, {"ready": False, "error": f"{exc!r}"})
        return
    zygote.serve()
