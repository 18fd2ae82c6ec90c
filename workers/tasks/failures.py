"""Failures end: a loop task that raises is counted on its run, retried with a backoff, and after
``max_task_failures`` of the same kind the run fails with the exception's text.

healthchecks' ``sendalerts`` pushes a failing check forward and re-raises, "otherwise sendalerts may end
up in a crash loop": a failure has to end somewhere. Here a task that raises (not one Celery retries by
itself: database hiccups are retried by ``TemperTask``) reaches ``task_failure``; the run counts it
(``services.do_record_task_failure``, one event each), and unless that failed the run, its work is
handed out again after ``2 ** n`` seconds (at most 30): groups a failed generation held go back to
admitted, a train step is re-sent as it was (its claim re-finds its groups).
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

from celery import signals

from workers.celery import app

log = logging.getLogger(__name__)

# task name -> how to find the run id from the task's arguments
_RUN_TASKS = {
    "workers.tasks.control.advance_run", "workers.tasks.control.report_step",
    "workers.tasks.rollout.generate", "workers.tasks.rollout.evaluate", "workers.tasks.train.train_step",
    "workers.tasks.verify.verify_batch", "workers.tasks.verify.score_evaluation",
}


def describe(exc: BaseException, tb: Any) -> str:
    """``Type: message`` and the innermost frame of our own code, so a person sees where it broke."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    ours = [f for f in frames if "/site-packages/" not in f.filename]
    where = f" (at {ours[-1].filename.rsplit('/', 2)[-2:][-1]}:{ours[-1].lineno} in {ours[-1].name})" if ours else ""
    return f"{type(exc).__name__}: {exc}{where}"[:2000]


def run_of(task_name: str, args: tuple[Any, ...] | list[Any]) -> int | None:
    if task_name in _RUN_TASKS and args and isinstance(args[0], int):
        return int(args[0])
    if task_name == "workers.tasks.verify.verify_group" and args:
        from webapp.runs.models import PromptGroup

        return PromptGroup.objects.filter(pk=args[0]).values_list("run_id", flat=True).first()
    return None


def retry_later(task_name: str, args: list[Any], count: int) -> None:
    """Hand the failed task's work out again after a backoff."""
    from webapp.runs import pipeline

    countdown = min(30, 2 ** count)
    if task_name == "workers.tasks.rollout.generate":
        run_id, group_ids = args[0], args[1]
        attempt = pipeline.release_generation(group_ids)
        if attempt is not None:
            app.send_task(task_name, (run_id, group_ids), countdown=countdown,
                          task_id=pipeline.generate_task_id(run_id, group_ids[0], attempt))
        return
    app.send_task(task_name, tuple(args), countdown=countdown)


@signals.task_failure.connect
def _on_task_failure(sender: Any = None, task_id: str | None = None, exception: BaseException | None = None,
                     args: Any = None, traceback: Any = None, **kwargs: Any) -> None:
    task_name = getattr(sender, "name", "")
    if exception is None or task_name.endswith(".ping"):
        return
    try:
        run_id = run_of(task_name, list(args or ()))
        if run_id is None:
            return
        from webapp.runs.models import RunStatus
        from webapp.runs.services import do_record_task_failure

        run = do_record_task_failure(run_id, task_name, describe(exception, traceback))
        if run is not None and run.status != RunStatus.FAILED:
            count = max(run.state.get("failures", {}).values(), default=1)
            retry_later(task_name, list(args or ()), count)
    except Exception:  # recording must never take the worker down with it
        log.exception("recording the failure of %s (%s) failed", task_name, task_id)
