"""Failures end: a loop task that raises is counted on its run (``services.do_record_task_failure``), and
its work is handed out again after a backoff (``recovery.retry_after_failure``) — until the run fails of
it. Database hiccups are retried by ``TemperTask`` first and never reach here."""

from __future__ import annotations

import logging
import traceback
from typing import Any

from celery import signals

from webapp.runs.loop import recovery
from webapp.runs.models import RunStatus
from webapp.runs.services import do_record_task_failure

log = logging.getLogger(__name__)


def describe(exc: BaseException, tb: Any) -> str:
    """``Type: message`` and the innermost frame of our own code, so a person sees where it broke."""
    ours = [f for f in (traceback.extract_tb(tb) if tb is not None else []) if "/site-packages/" not in f.filename]
    where = f" (at {ours[-1].filename.rsplit('/', 1)[-1]}:{ours[-1].lineno} in {ours[-1].name})" if ours else ""
    return f"{type(exc).__name__}: {exc}{where}"[:2000]


@signals.task_failure.connect
def _on_task_failure(sender: Any = None, task_id: str | None = None, exception: BaseException | None = None,
                     args: Any = None, traceback: Any = None, **kwargs: Any) -> None:
    name, arguments = getattr(sender, "name", ""), list(args or ())
    try:
        run_id = recovery.run_of_task(name, arguments)
        if exception is None or run_id is None:
            return
        run = do_record_task_failure(run_id, name, describe(exception, traceback))
        if run is not None and run.status != RunStatus.FAILED:
            recovery.retry_after_failure(name, arguments, max(run.state.get("failures", {}).values(), default=1))
    except Exception:  # recording must never take the worker down with it
        log.exception("recording the failure of %s (%s) failed", name, task_id)
