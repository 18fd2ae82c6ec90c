"""The public surface: specs in, verdicts out, artifacts, commands, pool lifecycle and metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import sandboxes
from sandboxes import Limits, SandboxPool, SandboxSpec, probe_tier

from .conftest import sandbox_processes, watch


def test_probe_tier_names_a_known_tier() -> None:
    tier = probe_tier()
    assert tier in ("namespaces+cgroup", "namespaces+rlimits", "rlimits-only")
    if os.geteuid() == 0:
        assert tier.startswith("namespaces")


def test_hello_world_result_and_summary(pool: SandboxPool) -> None:
    result = pool.run(SandboxSpec(code="print('hello')"))
    assert result.status == "ok" and result.exit_code == 0 and result.signal is None
    assert result.stdout == b"hello\n" and result.stderr == b""
    assert result.tier == pool.tier == probe_tier()
    assert result.report is not None and result.report.code_completed
    assert 0 <= result.cpu_seconds < 5 and 0 < result.wall_seconds < 5
    summary = json.loads(json.dumps(result.to_dict()))
    assert summary["status"] == "ok" and summary["stdout"] == "hello\n" and summary["tier"] == result.tier


def test_every_execution_starts_from_a_fresh_state(pool: SandboxPool) -> None:
    first = pool.run(SandboxSpec(code="import json, os\njson.MARK = 1\nopen('left-over', 'w').write('x')\n"))
    assert first.status == "ok"
    second = pool.run(SandboxSpec(code="import json, os\nprint(hasattr(json, 'MARK'), os.listdir('.'))\n"))
    assert second.stdout == b"False []\n"


def test_stdin_cwd_and_identity(pool: SandboxPool) -> None:
    result = pool.run(SandboxSpec(
        code="import os, socket, sys\nprint(sys.stdin.read().upper(), os.getcwd(), os.getuid() != 0, "
             "socket.gethostname(), os.getpid())",
        stdin=b"abc",
    ))
    assert result.stdout.decode().split() == ["ABC", "/tmp/work", "True", "sandbox", "1"]


def test_read_only_and_writable_inputs(pool: SandboxPool) -> None:
    result = pool.run(SandboxSpec(
        code=textwrap.dedent("""
            import os
            print(open("data/in.txt").read(), open("notes.txt").read())
            open("notes.txt", "a").write(" + more")
            os.remove("notes.txt")
            try:
                open("data/in.txt", "a")
            except PermissionError:
                print("read-only")
        """),
        files={"data/in.txt": "input"},
        writable_files={"notes.txt": b"notes"},
    ))
    assert result.status == "ok", result.stderr
    assert result.stdout == b"input notes\nread-only\n"


def test_artifacts_are_collected(pool: SandboxPool) -> None:
    result = pool.run(SandboxSpec(
        code="import os\nos.makedirs('out')\nopen('out/a.txt', 'w').write('A')\nopen('out/b.bin', 'wb').write(b'\\0B')\n"
             "os.symlink('/etc/passwd', 'out/passwd.txt')\nos.symlink('/etc', 'etc')\n",
        artifacts=("out/*", "etc/passwd", "missing.txt"),
    ))
    assert result.status == "ok", result.stderr
    by_path = {a.path: a for a in result.artifacts}
    assert set(by_path) == {"out/a.txt", "out/b.bin"}  # links out of the work directory are never followed
    assert by_path["out/a.txt"].data == b"A" and by_path["out/a.txt"].size == 1
    assert len(by_path["out/b.bin"].sha256) == 64


def test_artifacts_are_collected_after_a_timeout(pool: SandboxPool) -> None:
    result = pool.run(SandboxSpec(
        code="import time\nopen('progress.log', 'w').write('step 1')\ntime.sleep(60)\n",
        artifacts=("*.log",),
        limits=Limits(wall_seconds=1),
    ))
    assert result.status == "timeout"
    assert [(a.path, a.data) for a in result.artifacts] == [("progress.log", b"step 1")]


def test_artifacts_are_collected_after_an_oom_kill(pool: SandboxPool) -> None:
    if probe_tier() != "namespaces+cgroup":
        pytest.skip("an OOM kill needs a memory cgroup")
    result = pool.run(SandboxSpec(
        code="open('before-oom.txt', 'w').write('ok')\nx = []\nwhile True:\n    x.append(bytearray(8 << 20))\n",
        artifacts=("*.txt",),
        limits=Limits(memory_bytes=64 << 20),
    ))
    assert result.status == "memory_limit"
    assert [a.path for a in result.artifacts] == ["before-oom.txt"]


def test_memory_limits_above_and_below_the_default_and_recycled_cgroups(pool: SandboxPool) -> None:
    if probe_tier() != "namespaces+cgroup":
        pytest.skip("needs a memory cgroup")

    def alloc(mib: int, **limits: int) -> str:
        code = f"x = bytearray({mib} << 20)\nprint(len(x) >> 20)\n"
        return pool.run(SandboxSpec(code=code, limits=Limits(**limits))).status  # type: ignore[arg-type]

    assert alloc(600, memory_bytes=1 << 30) == "ok"  # above the default 512 MiB
    assert alloc(100, memory_bytes=64 << 20) == "memory_limit"
    # Cgroups are recycled between executions: each gets the default limits back, and an earlier
    # execution's OOM kill never counts against a later one.
    assert [alloc(100) for _ in range(6)] == ["ok"] * 6
    assert alloc(600) == "memory_limit"
    assert alloc(100) == "ok"


def test_command_runs_after_the_code_in_the_same_work_directory(pool: SandboxPool) -> None:
    result = pool.run(SandboxSpec(
        code="open('answer.txt', 'w').write('42')\nprint('code output')\n",
        files={"test.sh": "set -e\ntest \"$(cat answer.txt)\" = 42\necho checked\n"},
        command=["bash", "test.sh"],
    ))
    assert result.status == "ok", result.stderr
    assert result.stdout == b"code output\nchecked\n"  # in the order they were written
    assert result.report is not None and result.report.command_exit_code == 0 and result.passed
    failing = pool.run(SandboxSpec(code="pass", files={"test.sh": "exit 3\n"}, command=["bash", "test.sh"]))
    assert failing.status == "nonzero_exit"
    assert failing.report is not None and failing.report.command_exit_code == 3 and not failing.passed


def test_timeout_inside_the_epilogue_reports_what_ran(pool: SandboxPool) -> None:
    result = pool.run(SandboxSpec(
        code="import time\ndef slow():\n    time.sleep(60)\n",
        epilogue="assert 1 == 1\nslow()\nassert 2 == 2\n",
        limits=Limits(wall_seconds=1),
    ))
    assert result.status == "timeout"
    assert result.report is not None and result.report.code_completed
    assert [s.ok for s in result.report.statements] == [True, False, False]
    assert result.report.statements[1].error is not None and "not run" in result.report.statements[1].error
    assert not result.report.epilogue_completed


def test_bad_epilogue_and_bad_runtime_are_sandbox_errors(pool: SandboxPool) -> None:
    result = pool.run(SandboxSpec(code="pass", epilogue="assert (\n"))
    assert result.status == "sandbox_error" and result.error and "epilogue" in result.error
    result = pool.run(SandboxSpec(code="pass", runtime="cobol"))
    assert result.status == "sandbox_error" and result.error and "cobol" in result.error


def test_syntax_error_in_the_code(pool: SandboxPool) -> None:
    result = pool.run(SandboxSpec(code="def f(:\n", epilogue="assert True"))
    assert result.status == "nonzero_exit"
    assert result.report is not None and result.report.code_error is not None
    assert result.report.code_error.startswith("SyntaxError")
    assert b"SyntaxError" in result.stderr


def test_spec_validation() -> None:
    with pytest.raises(ValueError):
        SandboxSpec(code="", files={"../escape": "x"})
    with pytest.raises(ValueError):
        SandboxSpec(code="", artifacts=("/etc/passwd",))
    with pytest.raises(ValueError):
        SandboxSpec(code="", command="bash test.sh")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Limits(wall_seconds=0)


def test_stats_count_warm_hits_and_latency(pool: SandboxPool) -> None:
    before = pool.stats()
    for _ in range(3):
        assert pool.run(SandboxSpec(code="pass")).status == "ok"
    after = pool.stats()
    assert after["warm_hits"] - before["warm_hits"] == 3
    assert after["size"] == 2 and after["tier"] == probe_tier()
    assert after["start_latency_p50_ms"] is not None and after["start_latency_p50_ms"] > 0
    assert {"cold_starts", "failures", "start_latency_p95_ms", "executions"} <= set(after)


def test_concurrent_executions_use_several_zygotes(pool: SandboxPool) -> None:
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as executor:
        results = list(executor.map(lambda i: pool.run(SandboxSpec(code=f"print({i})")), range(8)))
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(8)]


def test_default_pool_run() -> None:
    result = sandboxes.run(SandboxSpec(code="print(6 * 7)"))
    assert result.stdout == b"42\n"
    from sandboxes.pool import default_pool

    watch(default_pool())


def test_close_stops_every_process() -> None:
    pool = SandboxPool(size=2)
    watch(pool)
    zygotes = list(pool.zygote_pids)
    assert pool.run(SandboxSpec(code="pass")).status == "ok"
    pool.close()
    for pid in zygotes:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(RuntimeError):
        pool.run(SandboxSpec(code="pass"))


def test_zygotes_die_with_their_owner() -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, time
            sys.path.insert(0, sys.argv[1])
            from sandboxes import SandboxPool, SandboxSpec, Limits
            pool = SandboxPool(size=1)
            print(pool.zygote_pids[0], flush=True)
            pool.run(SandboxSpec(code="import time; time.sleep(60)", limits=Limits(wall_seconds=60)))
        """), os.path.dirname(os.path.dirname(sandboxes.__file__))],
        stdout=subprocess.PIPE,
    )
    assert owner.stdout is not None
    zygote = int(owner.stdout.readline())
    time.sleep(0.3)  # the sleeping execution is in flight
    owner.send_signal(signal.SIGKILL)  # no atexit, no close(): the zygote must notice by itself
    owner.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(zygote, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the zygote outlived its owner")
    from sandboxes.zygote import UID_BASE

    leftover = [p for p in sandbox_processes() if p[0] == zygote]
    assert leftover == []
    uid_left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == UID_BASE + zygote:
                    uid_left.append(entry)
            except OSError:
                pass
    assert uid_left == []


def test_a_forked_child_gets_its_own_pool(pool: SandboxPool) -> None:
    assert sandboxes.run(SandboxSpec(code="pass")).status == "ok"  # the parent's default pool exists
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # like a Celery prefork child
        try:
            result = sandboxes.run(SandboxSpec(code="print('from the child')"))
            os.write(write_end, result.stdout)
        finally:
            os._exit(0)
    os.close(write_end)
    assert os.read(read_end, 100) == b"from the child\n"
    os.waitpid(child, 0)
    assert sandboxes.run(SandboxSpec(code="print('parent still fine')")).stdout == b"parent still fine\n"


def test_a_dead_zygote_is_replaced_by_a_cold_start() -> None:
    with SandboxPool(size=1) as pool:
        watch(pool)
        assert pool.run(SandboxSpec(code="pass")).status == "ok"
        os.kill(pool.zygote_pids[0], signal.SIGKILL)
        time.sleep(0.2)
        result = pool.run(SandboxSpec(code="print('after restart')"))
        watch(pool)
        assert result.stdout == b"after restart\n"
        stats = pool.stats()
        assert stats["cold_starts"] == 2 and len(pool.zygote_pids) == 2
