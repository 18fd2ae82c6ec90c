"""Every message of the loop, sent by its registered task name: the one place that knows what is sent where.

The web side and the tasks both send through here, so nothing imports ``workers.tasks`` to enqueue work
(that import is what tied ``webapp`` and ``workers`` into cycles). Routing stays Celery's
(``workers.celery``: queues by task module). Task ids are derived from the work they carry, so cancelling a
run can revoke its queued tasks without keeping a list of them: the database says which groups and which
train step are pending (``queued_ids``).

Imports only the Celery app: no Django, no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from workers import profiling
from workers.celery import app

log = logging.getLogger(__name__)

ADVANCE_RUN = "workers.tasks.control.advance_run"
KICK_ACTIVE_RUNS = "workers.tasks.control.kick_active_runs"
REPORT_STEP = "workers.tasks.control.report_step"
GENERATE = "workers.tasks.rollout.generate"
EVALUATE = "workers.tasks.rollout.evaluate"
TRAIN_STEP = "workers.tasks.train.train_step"
VERIFY_BATCH = "workers.tasks.verify.verify_batch"
VERIFY_GROUP = "workers.tasks.verify.verify_group"
SCORE_EVALUATION = "workers.tasks.verify.score_evaluation"
CALIBRATE_VERIFIER = "workers.tasks.verify.calibrate_verifier"
EXPORT_VERSION = "workers.tasks.export.export_version"
PING = "workers.tasks.health.ping"


# ---------------------------------------------------------------- task ids


def generate_id(run_id: int, first_group_id: int, attempt: int) -> str:
    return f"generate-r{run_id}-g{first_group_id}-a{attempt}"


def verify_id(run_id: int, group_id: int, attempt: int) -> str:
    return f"verify-r{run_id}-g{group_id}-a{attempt}"


def train_id(run_id: int, step: int) -> str:
    return f"train-r{run_id}-s{step}"


def eval_key(version: int, samples: int, task_id: int) -> str:
    """The group key of a held-out task's evaluation samples (``Trajectory.is_eval``)."""
    return f"eval-v{version}-k{samples}-t{task_id}"


# ---------------------------------------------------------------- sending


def _send(name: str, args: tuple[Any, ...], **options: Any) -> None:
    # Nobody waits on these results: without ignore_result, send_task subscribes this process to every
    # task's result channel (a Redis round trip per message, and a subscription per task in flight).
    with profiling.timed("broker"):
        app.send_task(name, args, ignore_result=True, **options)


def advance_run(run_id: int) -> None:
    _send(ADVANCE_RUN, (run_id,))


def kick_active_runs() -> None:
    _send(KICK_ACTIVE_RUNS, ())


def report_step(run_id: int, step: int) -> None:
    _send(REPORT_STEP, (run_id, step))


def generate(run_id: int, group_ids: list[int], attempt: int = 0, countdown: float | None = None) -> None:
    _send(GENERATE, (run_id, group_ids), task_id=generate_id(run_id, group_ids[0], attempt), countdown=countdown)


def generate_chunks(run_id: int, group_ids: list[int], size: int, attempts: dict[int, int] | None = None) -> None:
    """Generation of ``group_ids`` in tasks of at most ``size`` groups (each a fixed cost on the device)."""
    for chunk in (group_ids[i:i + size] for i in range(0, len(group_ids), size)):
        generate(run_id, chunk, (attempts or {}).get(chunk[0], 0))


def evaluate(run_id: int, version: int, offset: int = 0, samples: int | None = None, chain: str = "") -> None:
    """A version's held-out sampling; after its first chunk, the chunk from task ``offset`` on, with the
    evaluation's k and chain name (``heldout.sample``)."""
    _send(EVALUATE, (run_id, version, offset, samples, chain) if offset else (run_id, version))


def train_step(run_id: int, step: int, countdown: float | None = None) -> None:
    _send(TRAIN_STEP, (run_id, step), task_id=train_id(run_id, step), countdown=countdown)


def verify_batch(run_id: int, group_ids: list[int], attempts: list[int]) -> None:
    """One message for a rollout batch; a verify worker fans it out (``verify_groups``). It carries the first
    group's task id, so revoking a run's queued work covers it."""
    _send(VERIFY_BATCH, (run_id, group_ids, attempts), task_id=verify_id(run_id, group_ids[0], attempts[0]))


def verify_groups(run_id: int, group_ids: Iterable[int], attempts: Iterable[int]) -> None:
    """A ``verify_group`` message per group, over one broker connection."""
    with app.producer_or_acquire() as producer:
        for gid, attempt in zip(group_ids, attempts, strict=True):
            _send(VERIFY_GROUP, (gid,), producer=producer, task_id=verify_id(run_id, gid, attempt))


def score_evaluation(run_id: int, version: int, samples: int) -> None:
    _send(SCORE_EVALUATION, (run_id, version, samples))


def calibrate_verifier(report_id: int) -> None:
    _send(CALIBRATE_VERIFIER, (report_id,))


def export_version(version_id: int, fmt: str) -> None:
    _send(EXPORT_VERSION, (version_id, fmt))


def retry(name: str, args: tuple[Any, ...], countdown: float) -> None:
    """A failed task's work, again, later (``workers.tasks.failures``)."""
    _send(name, args, countdown=countdown)


def revoke(task_ids: list[str]) -> None:
    """Ask every worker to discard these queued tasks (one broadcast). A worker that misses it (started
    later, or Redis away) still does nothing: each task re-reads its run and finds it ended."""
    if not task_ids:
        return
    try:
        app.control.revoke(task_ids)
    except Exception as exc:  # the broadcast is an optimisation; the database already says "ended"
        log.warning("revoking %d task(s) failed: %s", len(task_ids), exc)
