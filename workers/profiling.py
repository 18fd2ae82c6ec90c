"""Where a worker's time goes, task by task: on when ``TEMPER_PROFILE`` names a directory, free otherwise.

Each Celery task a worker runs becomes one JSON line in ``$TEMPER_PROFILE/<worker pid>.jsonl``: its name,
its wall-clock start and end, and within it the seconds spent holding the device (``webapp.runs.loop.live``
reports them), in database calls (a Django ``execute_wrapper`` on the task thread's connection: every query
and its count) and sending messages to the broker. What is left of the wall time is Python: building
objects, (de)serializing, the verifiers' own work. ``bench/demo.py`` adds the lines up per train step.

Threads: each task runs on one thread of its worker (the prefork, solo and threads pools alike), so the
accumulators are thread-local.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DIRECTORY = os.environ.get("TEMPER_PROFILE", "")
ENABLED = bool(DIRECTORY)

_local = threading.local()
_write_lock = threading.Lock()


def add(kind: str, seconds: float, count: int = 1) -> None:
    """Charge ``seconds`` of ``kind`` (device, db, broker) to the task running on this thread."""
    acc = getattr(_local, "acc", None)
    if acc is not None:
        acc[kind] = acc.get(kind, 0.0) + seconds
        acc[f"{kind}_n"] = acc.get(f"{kind}_n", 0) + count


@contextmanager
def timed(kind: str) -> Iterator[None]:
    if not ENABLED:
        yield
        return
    started = time.perf_counter()
    try:
        yield
    finally:
        add(kind, time.perf_counter() - started)


def _db_wrapper(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
    started = time.perf_counter()
    try:
        return execute(sql, params, many, context)
    finally:
        add("db", time.perf_counter() - started)


def task_started(task_name: str, worker: str) -> None:
    from django.db import connection

    _local.acc = {"task": task_name, "worker": worker, "start": time.time()}
    if _db_wrapper not in connection.execute_wrappers:
        connection.execute_wrappers.append(_db_wrapper)


def task_finished() -> None:
    acc = getattr(_local, "acc", None)
    if acc is None:
        return
    _local.acc = None
    acc["end"] = time.time()
    acc["pid"] = os.getpid()
    acc["thread"] = threading.get_ident()
    line = json.dumps(acc) + "\n"
    with _write_lock, (Path(DIRECTORY) / f"{os.getpid()}.jsonl").open("a") as out:
        out.write(line)


def install() -> None:
    """Connect the recorder to Celery's task signals (a no-op unless ``TEMPER_PROFILE`` is set)."""
    if not ENABLED:
        return
    from celery.signals import task_postrun, task_prerun

    Path(DIRECTORY).mkdir(parents=True, exist_ok=True)

    @task_prerun.connect(weak=False)
    def _prerun(task: Any = None, **_: Any) -> None:
        hostname = str(getattr(getattr(task, "request", None), "hostname", "") or "")
        task_started(getattr(task, "name", "?"), hostname.split("@", 1)[0])

    @task_postrun.connect(weak=False)
    def _postrun(**_: Any) -> None:
        task_finished()
