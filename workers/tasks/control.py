"""Control-queue tasks: a run's tick, the periodic recovery tick, and a finished step's report."""

from __future__ import annotations

from django.conf import settings

from webapp.runs.loop import alerts, reporting, tick
from workers.celery import app


@app.task(name="workers.tasks.control.advance_run", ignore_result=True)
def advance_run(run_id: int) -> str:
    """Take the next step of a run's loop (idempotent: re-reads the run under its row lock)."""
    return tick.advance(run_id)


@app.task(name="workers.tasks.control.kick_active_runs", ignore_result=True)
def kick_active_runs() -> int:
    """Periodic (celery beat): hand out again what a lost message left behind, then check each run's health."""
    runs = tick.recover_all()
    for run_id in runs:
        alerts.check_run(run_id)
    return len(runs)


app.conf.beat_schedule = {
    "kick-active-runs": {"task": "workers.tasks.control.kick_active_runs",
                         "schedule": float(settings.TEMPER_KICK_SECONDS)},
}


@app.task(name="workers.tasks.control.report_step", ignore_result=True)
def report_step(run_id: int, step: int) -> int:
    """Metrics of a recorded train step, once; then health checks and evaluation."""
    return reporting.report_step(run_id, step)
