"""Hostile code, one attacked property per test. Each must get the right status, and (checked by the
autouse fixture in conftest) leave no process behind.

Every test that takes ``pool`` runs twice: in the default runtime and in the numpy runtime (its image
built once per machine, its zygotes preloading numpy), so a runtime's image weakens none of it.

Wall-clock assertions are generous: the machine is a loaded 2-core box; CPU time is what we judge.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import textwrap
import time
from typing import Any

import pytest

from sandboxes import Limits, SandboxPool, SandboxResult, SandboxSpec, runtimes

from .conftest import strays, watch


class InRuntime:
    """The session's pool, running every spec in one runtime."""

    def __init__(self, pool: SandboxPool, runtime: str) -> None:
        self._pool, self.runtime = pool, runtime

    def run(self, spec: SandboxSpec) -> SandboxResult:
        return self._pool.run(dataclasses.replace(spec, runtime=self.runtime))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


@pytest.fixture(params=["python", pytest.param("numpy", marks=pytest.mark.slow)])
def pool(request: pytest.FixtureRequest, pool: SandboxPool) -> Any:
    if request.param != "python":
        runtimes.ensure_image(runtimes.get(request.param))
        pool.run(SandboxSpec(code="pass", runtime=request.param))  # its zygote up: counted among the watched
        watch(pool)
    return InRuntime(pool, request.param)


def spec(code: str, **limits: float) -> SandboxSpec:
    return SandboxSpec(code=textwrap.dedent(code), limits=Limits(**limits))  # type: ignore[arg-type]


def test_the_image_and_the_interpreter_are_read_only(pool: SandboxPool) -> None:
    """Code cannot change the runtime it runs in: not its packages, not the standard library, for nobody
    after it either."""
    result = pool.run(spec("""
        import os, sys, sysconfig
        targets = [os.path.join(sysconfig.get_path("stdlib"), "json", "__init__.py")]
        try:
            import numpy
            targets += [numpy.__file__, os.path.join(os.path.dirname(numpy.__file__), "planted.py")]
        except ImportError:
            pass
        targets.append(os.path.join(sys.prefix, "planted.pth"))
        for target in targets:
            try:
                open(target, "a").write("raise SystemExit('planted')\\n")
                print("WROTE", target)
            except OSError as exc:
                print("refused", exc.errno)
    """))
    assert result.status == "ok" and b"WROTE" not in result.stdout, result.stdout
    assert result.stdout.count(b"refused") >= 2
    after = pool.run(spec("import json\ntry:\n    import numpy\nexcept ImportError:\n    pass\nprint('clean')"))
    assert after.stdout == b"clean\n"


def test_infinite_loop_is_stopped_by_the_cpu_limit(pool: SandboxPool) -> None:
    result = pool.run(spec("while True:\n    pass\n", cpu_seconds=1, wall_seconds=8))
    assert result.status == "timeout"
    # The CPU limit fires first, unless the machine is so loaded that the wall limit came first.
    assert result.cpu_seconds >= 0.9 or result.wall_seconds >= 8


def test_cpu_spin_that_ignores_signals_still_dies(pool: SandboxPool) -> None:
    result = pool.run(spec("""
        import signal
        for s in (signal.SIGXCPU, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM):
            signal.signal(s, signal.SIG_IGN)
        while True:
            pass
    """, cpu_seconds=1, wall_seconds=8))
    assert result.status == "timeout"
    assert result.signal == signal.SIGKILL  # the hard CPU limit cannot be ignored
    assert result.wall_seconds < 7.5


def test_sleep_past_the_wall_limit(pool: SandboxPool) -> None:
    result = pool.run(spec("import time\nprint('going to sleep', flush=True)\ntime.sleep(60)\n",
                           wall_seconds=1))
    assert result.status == "timeout"
    assert 1.0 <= result.wall_seconds < 5
    assert result.stdout == b"going to sleep\n"
    assert result.cpu_seconds < 0.5


def test_memory_bomb(pool: SandboxPool) -> None:
    result = pool.run(spec("""
        chunks = []
        while True:
            chunks.append(bytearray(8 << 20))
    """, memory_bytes=96 << 20, wall_seconds=20))
    assert result.status == "memory_limit", result.to_dict()
    assert result.peak_memory_bytes is not None and result.peak_memory_bytes <= 100 << 20


def test_fork_bomb(pool: SandboxPool) -> None:
    result = pool.run(spec("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, max_processes=16, wall_seconds=2, cpu_seconds=2))
    assert result.status in ("timeout", "killed"), result.to_dict()
    assert result.wall_seconds < 10


def test_detached_daemon_does_not_survive(pool: SandboxPool) -> None:
    result = pool.run(spec("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                for fd in range(3):
                    os.close(fd)
                while True:
                    with open("/tmp/work/daemon-was-here", "a") as f:
                        f.write("x")
                    time.sleep(0.01)
            os._exit(0)
        time.sleep(0.2)
        print("parent done")
    """, wall_seconds=10))
    assert result.status == "ok"
    assert result.stdout == b"parent done\n"
    assert result.wall_seconds < 5
    assert strays() == []  # immediately, not after the sandbox's wall limit


def test_a_thread_forking_while_the_verdict_is_returned(pool: SandboxPool) -> None:
    # The harness kills and reaps the rest of the namespace before the verdict; a thread of the code that
    # keeps forking races that, and must neither hang the verdict nor leave a process behind.
    result = pool.run(spec("""
        import os, threading, time
        def spawn():
            while True:
                try:
                    if os.fork() == 0:
                        time.sleep(60)
                        os._exit(0)
                except OSError:
                    time.sleep(0.001)
        threading.Thread(target=spawn, daemon=True).start()
        time.sleep(0.05)
        print("done", flush=True)
    """, wall_seconds=10))
    assert result.status == "ok", result.to_dict()
    assert result.stdout == b"done\n"
    assert result.wall_seconds < 5


def test_gigabytes_of_stdout(pool: SandboxPool) -> None:
    result = pool.run(spec("""
        import sys
        block = b"y" * (1 << 20)
        for _ in range(4096):  # 4 GiB
            sys.stdout.buffer.write(block)
    """, max_output_bytes=1 << 20, wall_seconds=20))
    assert result.status == "output_limit"
    assert result.stdout_truncated
    assert len(result.stdout) == 1 << 20
    assert result.wall_seconds < 10


def test_grandchild_holding_stdout_open(pool: SandboxPool) -> None:
    result = pool.run(spec("""
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # inherits stdout
        print("main program finished", flush=True)
    """, wall_seconds=10))
    assert result.status == "ok"
    assert result.stdout == b"main program finished\n"
    assert result.wall_seconds < 8  # not the grandchild's 60 s, not even the wall limit


@pytest.mark.parametrize("target", ["/etc/temper-sandbox-test", "/usr/temper-sandbox-test",
                                    "/root/temper-sandbox-test", "/var/tmp/temper-sandbox-test",
                                    "/dev/shm/temper-sandbox-test"])
def test_writing_outside_the_work_directory(pool: SandboxPool, target: str) -> None:
    result = pool.run(spec(f"""
        import os
        try:
            with open({target!r}, "w") as f:
                f.write("escaped")
        except OSError as exc:
            print(type(exc).__name__, exc.errno)
        else:
            print("WROTE")
    """))
    assert result.status == "ok"
    assert b"WROTE" not in result.stdout
    assert not os.path.exists(target)


def test_writing_into_the_project_checkout(pool: SandboxPool) -> None:
    # A victim file inside the checkout (never a real source file: if this ever failed, nothing is lost).
    victim = os.path.join(os.path.dirname(os.path.abspath(__file__)), f".victim-{os.getpid()}.py")
    with open(victim, "w") as f:
        f.write("original\n")
    try:
        result = pool.run(spec(f"""
            import os
            for attack in (lambda: os.chmod({victim!r}, 0o666), lambda: open({victim!r}, "w").write("pass"),
                           lambda: os.remove({victim!r})):
                try:
                    attack()
                    print("SUCCEEDED")
                except OSError as exc:
                    print("refused", exc.errno)
        """))
        assert b"SUCCEEDED" not in result.stdout and result.stdout.count(b"refused") == 3
        with open(victim) as f:
            assert f.read() == "original\n"
        assert os.stat(victim).st_mode & 0o777 != 0o666
    finally:
        os.unlink(victim)


def test_reading_etc_shadow(pool: SandboxPool) -> None:
    assert os.path.exists("/etc/shadow")
    result = pool.run(spec("""
        try:
            print(open("/etc/shadow").read())
        except PermissionError:
            print("denied")
    """))
    assert result.stdout == b"denied\n"


def test_reading_the_worker_environment() -> None:
    os.environ["TEMPER_TEST_SECRET"] = "hunter2-do-not-leak"
    try:
        with SandboxPool(size=1) as fresh:
            watch(fresh)
            result = fresh.run(spec("""
                import os, json
                print(json.dumps(dict(os.environ)))
            """))
    finally:
        del os.environ["TEMPER_TEST_SECRET"]
    env = json.loads(result.stdout)
    assert "TEMPER_TEST_SECRET" not in env
    assert "hunter2" not in result.stdout.decode()
    assert set(env) <= {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR", "USER", "LOGNAME",
                        "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING", "LC_CTYPE", "OPENBLAS_NUM_THREADS",
                        "OMP_NUM_THREADS", "MKL_NUM_THREADS"}


def test_reading_proc_1_environ(pool: SandboxPool) -> None:
    os.environ["TEMPER_TEST_SECRET2"] = "s3cr3t-value"
    try:
        result = pool.run(spec("""
            import os
            for path in ("/proc/1/environ", "/proc/self/environ", "/proc/2/environ"):
                try:
                    print(path, open(path, "rb").read())
                except OSError as exc:
                    print(path, "refused", exc.errno)
            print("pids", [p for p in os.listdir("/proc") if p.isdigit()])
        """))
    finally:
        del os.environ["TEMPER_TEST_SECRET2"]
    assert result.status == "ok"
    assert b"s3cr3t" not in result.stdout and b"TEMPER" not in result.stdout
    pids = json.loads(result.stdout.splitlines()[-1].split(b"pids ", 1)[1].replace(b"'", b'"'))
    assert set(pids) <= {"1", "2", "3"}  # only the sandbox's own processes are visible


def test_connecting_to_local_redis(pool: SandboxPool) -> None:
    result = pool.run(spec("""
        import socket, time
        t = time.monotonic()
        try:
            socket.create_connection(("127.0.0.1", 6379), timeout=5)
            print("CONNECTED")
        except OSError as exc:
            print("failed", exc.errno, round(time.monotonic() - t, 3))
    """))
    assert result.stdout.startswith(b"failed"), result.stdout
    assert float(result.stdout.split()[-1]) < 1.0


def test_connecting_to_an_outside_address(pool: SandboxPool) -> None:
    # 192.0.2.1 is TEST-NET-1: never routed. Without a network the failure is immediate.
    result = pool.run(spec("""
        import errno, socket, time
        t = time.monotonic()
        try:
            socket.create_connection(("192.0.2.1", 80), timeout=5)
            print("CONNECTED")
        except OSError as exc:
            print(errno.errorcode.get(exc.errno, exc.errno), round(time.monotonic() - t, 3))
    """))
    assert result.stdout.startswith(b"ENETUNREACH"), result.stdout
    assert float(result.stdout.split()[-1]) < 1.0


def test_bringing_loopback_up_is_refused(pool: SandboxPool) -> None:
    # Network namespaces are reused between executions (see Zygote._new_netns): that is safe only as long
    # as the sandbox cannot change its namespace. SIOCSIFFLAGS on lo needs CAP_NET_ADMIN there.
    result = pool.run(spec("""
        import errno, fcntl, socket, struct
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        ifreq = struct.pack("16sH14x", b"lo", 0x1 | 0x8)  # IFF_UP | IFF_LOOPBACK
        try:
            fcntl.ioctl(s.fileno(), 0x8914, ifreq)  # SIOCSIFFLAGS
            print("UP")
        except OSError as exc:
            print(errno.errorcode.get(exc.errno, exc.errno))
        print(open("/proc/net/dev").read().count(":"), "interfaces")
    """))
    assert result.status == "ok", result
    assert result.stdout.splitlines()[0] == b"EPERM", result.stdout
    assert result.stdout.splitlines()[1] == b"1 interfaces", result.stdout  # lo only


def test_nothing_network_carries_over_to_the_next_execution(pool: SandboxPool) -> None:
    """A listener (an abstract unix socket) kept by a detached child must be gone for every later
    execution, whichever reused network namespace it gets."""
    planted = pool.run(spec("""
        import os, socket, time
        u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        u.bind(b"\\0temper-leak")
        u.listen(1)
        if os.fork() == 0:
            os.setsid()
            time.sleep(60)
        print(open("/proc/net/unix").read().count("temper-leak"))
    """))
    assert planted.status == "ok" and planted.stdout.strip() == b"1", planted
    for _ in range(6):  # more than the pool's standbys and spare namespaces: every namespace comes round
        result = pool.run(spec("""
            import socket
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                c.connect(b"\\0temper-leak")
                print("CONNECTED")
            except OSError as exc:
                print("refused", exc.errno)
            print(open("/proc/net/unix").read().count("temper-leak"))
        """))
        assert result.status == "ok", result
        assert result.stdout.split() == [b"refused", b"111", b"0"], result.stdout  # ECONNREFUSED


def test_live_sandboxes_never_share_a_network_namespace(pool: SandboxPool) -> None:
    """Every sandbox process alive at once (the standbys waiting, across zygotes) is in a network namespace
    of its own, and none is in the host's."""
    if pool.tier == "rlimits-only":
        pytest.skip("no namespaces in this tier")
    pool.run(spec("pass"))  # make sure every zygote has its standbys out
    host = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + 10
    while True:
        standbys = [pid for z in pool.zygote_pids for pid in _children(z)]
        spaces = [_netns(pid) for pid in standbys]
        if len(standbys) >= 2 * len(pool.zygote_pids) and host not in spaces and None not in spaces:
            break  # each standby has entered its namespace
        assert time.monotonic() < deadline, (standbys, spaces)
        time.sleep(0.02)
    assert len(set(spaces)) == len(spaces), spaces


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _netns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def test_killing_the_parent(pool: SandboxPool) -> None:
    result = pool.run(spec("""
        import os, signal
        print("parent as seen from inside:", os.getppid(), flush=True)  # 0: it is outside the namespace
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        for pid in [os.getppid(), -1, *pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        print("still here", flush=True)  # signals to itself (PID 1 of the namespace) are ignored
    """))
    assert result.status == "ok"
    assert result.stdout == b"parent as seen from inside: 0\nstill here\n"
    for zygote in pool.zygote_pids:
        os.kill(zygote, 0)  # alive
    assert pool.run(spec("print('still serving')")).stdout == b"still serving\n"


def test_filling_the_disk(pool: SandboxPool) -> None:
    result = pool.run(spec("""
        i = 0
        while True:
            with open(f"fill-{i}", "wb") as f:
                f.write(b"\\0" * (4 << 20))
            i += 1
    """, wall_seconds=20))
    assert result.status == "nonzero_exit"
    assert result.report is not None and "No space left" in (result.report.code_error or "")
    assert b"OSError" in result.stderr


def test_one_huge_file_hits_the_file_size_limit(pool: SandboxPool) -> None:
    result = pool.run(spec("""
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        with open("big", "wb") as f:
            f.write(b"\\0" * (8 << 20))
    """, max_file_bytes=1 << 20))
    assert result.status == "nonzero_exit"
    assert result.report is not None and "File too large" in (result.report.code_error or "")


def test_binary_and_invalid_utf8_output(pool: SandboxPool) -> None:
    payload = bytes(range(256)) + b"\xff\xfe\xc3\x28"
    result = pool.run(spec(f"""
        import sys
        sys.stdout.buffer.write({payload!r})
        sys.stderr.buffer.write(b"\\x80\\x81")
    """))
    assert result.status == "ok"
    assert result.stdout == payload
    assert result.stderr == b"\x80\x81"
    json.dumps(result.to_dict())  # still a JSON-able summary


def test_segfault(pool: SandboxPool) -> None:
    result = pool.run(spec("import faulthandler\nfaulthandler.disable()\nfaulthandler._read_null()\n"))
    assert result.status == "killed"
    assert result.signal == signal.SIGSEGV
    assert result.report is not None and not result.report.code_completed


def test_nothing_is_left_after_a_timeout_with_children(pool: SandboxPool) -> None:
    result = pool.run(spec("""
        import os, time
        for _ in range(5):
            if os.fork() == 0:
                while True:
                    pass
        time.sleep(60)
    """, wall_seconds=1))
    assert result.status == "timeout"
    assert strays() == []
