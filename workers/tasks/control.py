"""Control-queue tasks: move a run through its lifecycle and (later) schedule its pipeline."""

from __future__ import annotations

import logging

from workers.celery import app

log = logging.getLogger(__name__)


@app.task(name="workers.tasks.control.advance_run")
def advance_run(run_id: int) -> str:
    """Take the next lifecycle step of a run. Idempotent: re-reads the run and acts on its current state."""
    from webapp.common.errors import InvalidTransition
    from webapp.runs import services
    from webapp.runs.models import Run, RunStatus

    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        return "gone"
    try:
        if run.status == RunStatus.QUEUED:
            services.do_mark_running(run)
            return "running"
        if run.status == RunStatus.PAUSING:
            # Nothing is in flight between steps yet: the saved state is complete, so the pause is done.
            services.do_mark_paused(run)
            return "paused"
    except InvalidTransition as exc:  # another delivery or a person moved it first
        log.info("advance_run(%s): %s", run_id, exc)
    return str(Run.objects.filter(pk=run_id).values_list("status", flat=True).first())
