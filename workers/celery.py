"""The Celery app: four queues, routing by task module, and at-least-once delivery settings.

Queues: ``control`` (run lifecycle, scheduling), ``rollout`` and ``train`` (the GPU worker keeps the engine
resident), ``verify`` (sandbox workers). Tasks are ``acks_late`` with prefetch 1 and
``reject_on_worker_lost``, so a killed worker's task is delivered again; every task is idempotent.
"""

from __future__ import annotations

import os

from celery import Celery, Task
from celery.signals import celeryd_init, task_prerun, worker_init
from django.db.utils import InterfaceError, OperationalError
from kombu import Exchange, Queue

from workers.policy import device_process, resident

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

QUEUES = ("control", "rollout", "train", "verify")


class TemperTask(Task):
    """Database hiccups (a locked SQLite file, a dropped PostgreSQL connection) are retried, not lost.

    The loop's tasks ignore their results (nobody waits on them), but a failure or a revocation is still
    stored, so ``AsyncResult(id).state`` tells what became of a task.
    """

    autoretry_for = (OperationalError, InterfaceError)
    store_errors_even_if_ignored = True
    retry_backoff = 1
    retry_backoff_max = 30
    max_retries = 8


app = Celery("temper", task_cls=TemperTask)
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.update(
    task_queues=[Queue(name, Exchange(name, type="direct"), routing_key=name) for name in QUEUES],
    task_default_queue="control",
    task_default_exchange="control",
    task_default_routing_key="control",
    task_routes={
        "workers.tasks.control.*": {"queue": "control"},
        "workers.tasks.rollout.*": {"queue": "rollout"},
        "workers.tasks.train.*": {"queue": "train"},
        "workers.tasks.verify.*": {"queue": "verify"},
    },
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_expires=3600,
    task_track_started=True,
    broker_connection_retry_on_startup=True,
    # An unacknowledged task is redelivered after this long; tasks are one short step each.
    broker_transport_options={"visibility_timeout": 3600},
    worker_hijack_root_logger=False,
    imports=["workers.tasks.health", "workers.tasks.control", "workers.tasks.rollout", "workers.tasks.train",
             "workers.tasks.verify", "workers.tasks.export", "workers.tasks.failures"],
)



@worker_init.connect(weak=False)
def _no_query_log(**_: object) -> None:
    """A worker serves no request, so ``DEBUG``'s one effect there is that Django logs every query: on SQLite
    with an extra ``SELECT QUOTE(?)…`` per statement to render its parameters, the cost of a step's bulk
    writes twice over (``bench/demo.py``), and Celery warns of the memory it holds. Pages keep ``DEBUG``."""
    from django.conf import settings

    settings.DEBUG = False


KEEP_CONNECTIONS = "DB_CONN_MAX_AGE" not in os.environ
"""A worker keeps its database connection between tasks (one per pool thread or process) unless
``DB_CONN_MAX_AGE`` says otherwise. Celery's Django fixup closes it before and after every task unless
``CELERY_DB_REUSE_MAX`` is set, so every task paid a connect (on SQLite, an open and two PRAGMAs: ~6 % of a
verify task, on each step's critical path, ``bench/demo.py``). It is checked before each task instead, as
Django checks it before each request (``close_old_connections``: closed after an error it does not survive,
a PostgreSQL connection pinged first)."""
if KEEP_CONNECTIONS:
    app.conf.update(CELERY_DB_REUSE_MAX=2**62)  # the fixup's own name; it counts tasks up to twice this


@worker_init.connect(weak=False)
def _keep_connections(**_: object) -> None:
    from django.db import connections

    if KEEP_CONNECTIONS:
        for alias in connections:
            connections.settings[alias].update(CONN_MAX_AGE=None, CONN_HEALTH_CHECKS=True)


@task_prerun.connect(weak=False)
def _check_connections(task: Task | None = None, **_: object) -> None:
    # an eager task runs inside its caller's request or transaction: its connection is the caller's
    if KEEP_CONNECTIONS and not (task is not None and getattr(task.request, "is_eager", False)):
        from django.db import close_old_connections

        close_old_connections()


@celeryd_init.connect(weak=False)
def _start_device(options: dict[str, object] | None = None, **_: object) -> None:
    """A GPU worker (one that consumes the rollout or train queue) starts its device process as it starts
    (``workers.policy.device_process``: the engines, the trainers and every stretch of device work, beside
    this process's bookkeeping), whose imports overlap the worker's own start. ``TEMPER_DEVICE_PROCESS=0``
    keeps them in this process instead (imported on a thread of its own, ``resident.warm_up``)."""
    queues = (options or {}).get("queues") or ""
    names = queues.split(",") if isinstance(queues, str) else list(queues)  # type: ignore[call-overload]
    if not {"rollout", "train"} & set(names):
        return
    if device_process.enabled():
        device_process.start()  # (``workers.gpu_worker`` started it already)
        resident.keep_off_device_cpus()  # the device process has them (its affinity is its own from now on)
    else:
        resident.warm_up()


# Where each task's time goes, when TEMPER_PROFILE names a directory (bench/demo.py): a no-op otherwise.
from workers import profiling  # noqa: E402

profiling.install()
