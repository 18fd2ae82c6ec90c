"""Sandbox sessions: state across the calls of one episode, none across episodes, and nothing left running.

One attacked property per test: an episode cannot see the previous episode's variables or files; a session's
processes are gone when its episode ends, when its deadline passes and after its owner is SIGKILLed; a cell
that loops forever becomes a ``timeout`` and the session goes on (or, when it will not be interrupted, ends).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandboxes.session import SessionLimits, SessionPool, SessionSpec, sweep, write_lease

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pool() -> Iterator[SessionPool]:
    with SessionPool() as p:
        if p.tier == "rlimits-only":
            pytest.skip("sessions need the namespaces tier (root or user namespaces)")
        yield p


def processes_with(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_sleeper(session, marker: str) -> None:
    """A detached grandchild that would sleep an hour (its argv carries the marker)."""
    result = session.run(f"import subprocess\nsubprocess.Popen(['sleep', '3600.{marker}'], start_new_session=True)")
    assert result.status == "ok", result
    deadline = time.monotonic() + 5
    while not processes_with(f"3600.{marker}"):
        assert time.monotonic() < deadline, "the sleeper did not start"
        time.sleep(0.05)


def wait_gone(marker: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while processes_with(f"3600.{marker}"):
        assert time.monotonic() < deadline, f"still running: {processes_with(f'3600.{marker}')}"
        time.sleep(0.05)


def test_variables_and_files_live_across_the_cells_of_a_session(pool):
    with pool.session(SessionSpec(files={"data.txt": "abc"})) as s:
        assert s.run("x = [1, 2]").status == "ok"
        assert s.run("x.append(3)\nopen('notes.txt', 'w').write('kept')").status == "ok"
        out = s.run("print(sum(x), open('notes.txt').read(), open('data.txt').read())")
        assert (out.status, out.stdout) == ("ok", "6 kept abc\n")
        failed = s.run("undefined_name")
        assert failed.status == "error" and failed.error.startswith("NameError")
        assert "harness" not in failed.stderr and "<cell" in failed.stderr  # the cell's traceback, not ours
        assert s.run("print(len(x))").stdout == "3\n"  # an error does not lose the state


def test_an_episode_cannot_see_the_previous_episodes_variables_or_files(pool):
    with pool.session() as first:
        first.run("secret = 'episode-one'\nopen('left.txt', 'w').write('episode-one')")
        first_pid = first.pid
    with pool.session() as second:
        assert second.pid != first_pid
        seen = second.run("import os\nprint('secret' in globals(), os.listdir('.'))")
        assert seen.stdout == "False []\n", seen
        probe = second.run(textwrap.dedent("""
            import glob
            hits = [p for p in glob.glob('/tmp/**', recursive=True) if 'left' in p]
            print(hits)
        """))
        assert probe.stdout == "[]\n", probe


def test_a_sessions_processes_are_gone_when_its_episode_ends(pool):
    marker = str(uuid.uuid4().int)[:9]
    session = pool.open()
    start_sleeper(session, marker)
    assert session.run("print('between cells the sleeper lives on')").status == "ok"
    assert processes_with(f"3600.{marker}")
    session.close()  # returns once the session's init has exited: its namespace is empty by then
    assert processes_with(f"3600.{marker}") == [] and not running(session.pid)


def test_a_session_past_its_deadline_is_killed_whatever_it_does(pool):
    marker = str(uuid.uuid4().int)[:9]
    session = pool.open(SessionSpec(limits=SessionLimits(deadline_seconds=2.0, cell_wall_seconds=1.0)))
    start_sleeper(session, marker)
    wait_gone(marker, timeout=6.0)  # nobody calls the session: the pool's watchdog kills it
    after = session.run("print(1)")
    assert after.status == "session_error" and "deadline" in (after.error or "")
    session.close()


def test_a_cell_that_loops_forever_is_a_timeout_and_the_session_goes_on(pool):
    with pool.session(SessionSpec(limits=SessionLimits(cell_wall_seconds=0.5))) as s:
        s.run("n = 41")
        started = time.monotonic()
        looped = s.run("while True:\n    pass")
        assert looped.status == "timeout" and "interrupted" in (looped.error or "")
        assert time.monotonic() - started < 3.0
        assert s.run("n += 1\nprint(n)").stdout == "42\n"


def test_a_cell_that_refuses_to_be_interrupted_ends_its_session(pool):
    marker = str(uuid.uuid4().int)[:9]
    with pool.session(SessionSpec(limits=SessionLimits(cell_wall_seconds=0.5))) as s:
        start_sleeper(s, marker)
        stuck = s.run("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass")
        assert stuck.status == "timeout" and "killed" in (stuck.error or "")
        assert s.run("print(1)").status == "session_error"
        wait_gone(marker, timeout=5.0)


def test_a_session_dies_with_its_owner_and_the_sweeper_clears_what_is_left(tmp_path):
    marker = str(uuid.uuid4().int)[:9]
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from sandboxes.session import SessionPool
        pool = SessionPool()
        session = pool.open()
        session.run("import subprocess; subprocess.Popen(['sleep', '3600.{marker}'], start_new_session=True)")
        print(session.pid, flush=True)
        time.sleep(3600)
    """)], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    pid = int(owner.stdout.readline())
    assert processes_with(f"3600.{marker}") and os.path.exists(f"/proc/{pid}")
    owner.kill()  # SIGKILL: nothing of the owner runs any more
    owner.wait()
    wait_gone(marker, timeout=10.0)
    # its init may still be in its exit path (reaping the namespace) a moment after the last child is gone
    deadline = time.monotonic() + 10.0
    while running(pid):
        assert time.monotonic() < deadline, f"session {pid} still running 10 s after its owner was killed"
        time.sleep(0.05)
    # a lease its owner left behind is swept, and a live session it names would be killed
    decoy = subprocess.Popen(["sleep", f"3600.{marker}9"])
    try:
        lease = write_lease(decoy.pid, time.time() - 10)  # its deadline passed
        assert decoy.pid in sweep() and not lease.exists()
        decoy.wait(5)
    finally:
        decoy.kill()


def test_writing_outside_the_work_directory_is_refused(pool):
    with pool.session() as s:
        denied = s.run("open('/etc/temper-session-test', 'w')")
        assert denied.status == "error" and ("Read-only" in denied.error or "Permission" in denied.error)


def test_sessions_work_when_the_worker_holds_more_than_1024_descriptors(pool):
    """select(2) cannot watch a descriptor above 1023: a GPU worker holding a hundred sessions reached that
    ("filedescriptor out of range in select()") and every later episode ended on env_error."""
    with descriptor_limit(2048):
        held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
        try:
            sessions = [pool.open() for _ in range(3)]
            for i, s in enumerate(sessions):
                assert s.run(f"print({i} * 7)").stdout == f"{i * 7}\n"
            for s in sessions:
                s.close()
                assert not running(s.pid)
        finally:
            for fd in held:
                os.close(fd)


def test_three_hundred_sessions_live_at_once_and_all_close():
    """A GPU worker plays two batches of 128 episodes at once, each holding a session: the owner then holds
    well over 1024 descriptors (select(2) there failed on them; the zygote polls too)."""
    # the pool starts after the limit is raised: the zygote inherits it
    with descriptor_limit(8192), SessionPool() as many:
        if many.tier == "rlimits-only":
            pytest.skip("sessions need the namespaces tier")
        sessions = [many.open() for _ in range(300)]
        outputs = [s.run(f"print({i} + 1)").stdout for i, s in enumerate(sessions)]
        assert outputs == [f"{i + 1}\n" for i in range(300)]
        for s in sessions:
            s.close()
        assert not [s.pid for s in sessions if running(s.pid)]
        with many.open() as after:  # the pool goes on
            assert after.run("print('still here')").stdout == "still here\n"


@contextlib.contextmanager
def descriptor_limit(n: int) -> Iterator[None]:
    """This process's soft descriptor limit raised to ``n`` for the block (skip when the hard one is lower)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < n:
        pytest.skip(f"cannot raise the descriptor limit to {n}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
