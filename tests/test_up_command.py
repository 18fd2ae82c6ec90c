"""``make run``'s process supervisor: everything starts, the pages answer, and Ctrl-C leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port

pytestmark = pytest.mark.slow


def stat(pid: int | str) -> list[str]:
    """/proc/PID/stat from its third field on (state, ppid, ...): the name before them may hold spaces."""
    return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int(stat(entry.name)[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = stat(pid)[0]
    except OSError:
        return False
    return state != "Z"


def test_up_serves_pages_and_ctrl_c_stops_everything(tmp_path: Path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(TEMPER_VAR_DIR=str(tmp_path), TEMPER_EMBEDDED_REDIS_PORT=str(free_port()), PORT=str(port),
               PYTHONUNBUFFERED="1")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    log = (tmp_path / "up.log").open("wb")
    proc = subprocess.Popen([sys.executable, "manage.py", "up"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while b"Temper is running" not in (tmp_path / "up.log").read_bytes():
            assert proc.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no URL printed within 120 s"
            time.sleep(0.5)
        text = (tmp_path / "up.log").read_text()
        assert f"http://127.0.0.1:{port}/" in text and "log in as demo / " in text
        password = text.split("log in as demo / ", 1)[1].split(";", 1)[0]
        assert (tmp_path / "demo_password").read_text().strip() == password
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/login/").status == 200
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/login/").status == 200
        children = descendants(proc.pid)
        assert len(children) >= 5  # redis, daphne, three celery workers (and their pool processes)
        # the sandbox workers (and their pool processes) yield the CPU to the web server, the control worker and
        # the GPU worker; the GPU worker's device process has a CPU of its own, which the others stay off but
        # the sandbox workers (below it)
        niceness = {}
        for pid in children:
            with contextlib.suppress(OSError):
                niceness[cmdline_of(pid)] = int(stat(pid)[16])  # the 19th field of /proc/PID/stat
        by_role = {role: {n for cmd, n in niceness.items() if marker in cmd}
                   for role, marker in (("gpu", "gpu@%h"), ("sandbox", "sandbox@%h"), ("control", "control@%h"),
                                        ("web", "daphne"), ("device", "workers.policy.device_process"))}
        assert by_role == {"gpu": {0}, "sandbox": {10}, "control": {0}, "web": {0}, "device": {0}}, by_role
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) > 1:
            device = next(pid for pid in children if "workers.policy.device_process" in cmdline_of(pid))
            deadline = time.monotonic() + 30
            while os.sched_getaffinity(device) != {cpus[-1]}:  # it pins itself as it starts
                assert time.monotonic() < deadline, os.sched_getaffinity(device)
                time.sleep(0.2)
            affinity = {role: {frozenset(os.sched_getaffinity(pid)) for pid in children if marker in cmdline_of(pid)}
                        for role, marker in (("web", "daphne"), ("control", "control@%h"), ("sandbox", "sandbox@%h"))}
            assert affinity == {"web": {frozenset(cpus[:-1])}, "control": {frozenset(cpus[:-1])},
                                "sandbox": {frozenset(cpus)}}, affinity
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        proc.wait(60)
        log.close()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [pid for pid in children if alive(pid)]
    assert not left, f"left running after Ctrl-C: {left}"
    assert proc.returncode == 0, (tmp_path / "up.log").read_text()[-2000:]
    assert "Temper stopped." in (tmp_path / "up.log").read_text()


def cmdline_of(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def processes_with_env(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (every child of ``up`` inherits it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "environ").read_bytes() and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.parametrize("after", [1.5, 5.0])
def test_ctrl_c_during_start_up_leaves_nothing(tmp_path: Path, after: float):
    """Ctrl-C while the children are still starting (Redis, beat, workers half up) stops every one of them."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    marker = f"TEMPER_VAR_DIR={tmp_path}"
    env.update(TEMPER_VAR_DIR=str(tmp_path), TEMPER_EMBEDDED_REDIS_PORT=str(free_port()), PORT=str(free_port()))
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    proc = subprocess.Popen([sys.executable, "manage.py", "up", "--no-demo"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(after)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(60)
    deadline = time.monotonic() + 30
    while processes_with_env(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_with_env(marker) == []


def _api_get(port: int, path: str, token: str) -> dict:
    import json

    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Token {token}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def _token(port: int, password: str) -> str:
    import json
    import urllib.parse

    body = urllib.parse.urlencode({"username": "demo", "password": password}).encode()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/auth/token/", data=body, timeout=5) as response:
        return str(json.loads(response.read())["token"])


def _up(tmp_path: Path, env: dict[str, str], name: str) -> tuple[subprocess.Popen[bytes], float, str]:
    """Start ``manage.py up``; return it, when its page answered (monotonic), and the demo password."""
    path = tmp_path / f"{name}.log"
    log = path.open("wb")
    proc = subprocess.Popen([sys.executable, "manage.py", "up"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while b"Temper is running" not in path.read_bytes():
        assert proc.poll() is None, path.read_text()[-3000:]
        assert time.monotonic() < deadline, "no URL printed within 120 s"
        time.sleep(0.2)
    answered = time.monotonic()
    password = path.read_text().split("log in as demo / ", 1)[1].split(";", 1)[0]
    return proc, answered, password


def _ctrl_c(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(60)
    assert proc.returncode == 0


def test_ctrl_c_mid_run_and_up_again_resumes_at_once_and_loses_nothing(tmp_path: Path):
    """The demo run is stopped mid-run with Ctrl-C and `up` is started again: the run moves within 15 s of
    the page answering (its lost messages are re-issued at once, not after the stall timeout), and every
    admitted group is still trained exactly once or dropped with a reason."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(TEMPER_VAR_DIR=str(tmp_path), TEMPER_EMBEDDED_REDIS_PORT=str(free_port()), PORT=str(port),
               PYTHONUNBUFFERED="1")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    proc, _, password = _up(tmp_path, env, "first")
    try:
        token = _token(port, password)
        deadline = time.monotonic() + 180
        while _api_get(port, "/api/v1/runs/1/", token)["step"] < 4:
            assert time.monotonic() < deadline, "the demo run made no 4 steps in 180 s"
            time.sleep(0.5)
    finally:
        _ctrl_c(proc)
    proc, answered, password = _up(tmp_path, env, "second")
    try:
        token = _token(port, password)
        stopped_at = _api_get(port, "/api/v1/runs/1/", token)
        assert stopped_at["status"] == "running"
        while (now := _api_get(port, "/api/v1/runs/1/", token))["step"] <= stopped_at["step"]:
            assert time.monotonic() - answered < 15, (
                f"still at step {now['step']} {time.monotonic() - answered:.0f} s after the page answered")
            time.sleep(0.25)
        resumed_after = time.monotonic() - answered
        deadline = time.monotonic() + 60
        while _api_get(port, "/api/v1/runs/1/", token)["step"] < stopped_at["step"] + 3:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    finally:
        _ctrl_c(proc)
    # the books, read from the run's own database after both lives: nothing lost, nothing trained twice
    check = subprocess.run([sys.executable, "manage.py", "shell", "-c", (
        "from webapp.runs.loop.accounting import accounting; from webapp.runs.models import Run; "
        "a = accounting(Run.objects.get(pk=1)); print('PROBLEMS', a.problems, a.by_status, a.steps)")],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    line = next(ln for ln in check.stdout.splitlines() if ln.startswith("PROBLEMS"))
    assert line.startswith("PROBLEMS []"), line
    print(f"resumed {resumed_after:.1f} s after the page answered; {line}")
