"""``make run``'s process supervisor: everything starts, the pages answer, and Ctrl-C leaves nothing behind."""

from __future__ import annotations

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


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
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
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
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
