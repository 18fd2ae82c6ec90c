"""``python -m workers.gpu_worker [celery worker options]``: a GPU worker, ``celery -A workers.celery worker``
with its device process (``workers.policy.device_process``) started first.

Celery's start — its command line, the app, Django and the task modules — takes ~1.5 s before its first
signal; started here, the device process's own imports (~4 s of torch and transformers, the longest start
of any role) run meanwhile. ``manage.py up`` and docker-compose start GPU workers this way; a plain ``celery
worker`` on the rollout or train queue starts its device process at its ``celeryd_init`` (``workers.celery``),
that much later. ``TEMPER_DEVICE_PROCESS=0`` starts none.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from workers.policy import device_process

    if device_process.enabled():
        device_process.start()  # the worker's own celeryd_init finds it started
    from celery.__main__ import main as celery

    sys.argv = ["celery", "-A", "workers.celery", "worker", *argv]
    celery()


if __name__ == "__main__":
    main(sys.argv[1:])
