"""A trivial task per queue, to check that a worker consumes it: ``ping.apply_async(queue=...)``."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from workers.celery import QUEUES, app


@app.task(name="workers.tasks.health.ping")
def ping(payload: Any = None) -> dict[str, Any]:
    return {"pong": payload, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}


def ping_all(timeout: float = 10.0) -> dict[str, dict[str, Any]]:
    """Round-trip a ping through every queue; raises on the first queue that does not answer in time."""
    return {queue: ping.apply_async(args=[queue], queue=queue).get(timeout=timeout) for queue in QUEUES}
