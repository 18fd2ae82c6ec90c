"""Verify-queue tasks: judge a group's samples, score an evaluation, calibrate a verifier."""

from __future__ import annotations

from webapp.catalog.models import CalibrationReport
from webapp.catalog.services import do_run_calibration
from webapp.runs.loop import heldout, verification
from workers import messages
from workers.celery import app
from workers.tasks.health import this_worker


@app.task(name="workers.tasks.verify.verify_batch", ignore_result=True)
def verify_batch(run_id: int, group_ids: list[int], attempts: list[int]) -> str:
    """A rollout batch: the groups an in-process verifier judges in microseconds, and those a remote judge
    is asked about (every sample at once, on this process's judge threads), are judged here, together
    (``verification.verify_groups``); every other group gets a ``verify_group`` message of its own, so
    CPU-bound verifiers (sandboxes, episodes) spread over the verify workers. With none of the first kinds,
    the first group is judged here."""
    together = set(verification.batched_groups(group_ids))
    apart = [(gid, attempt) for gid, attempt in zip(group_ids, attempts, strict=True) if gid not in together]
    if not together and apart:
        together.add(apart.pop(0)[0])
    messages.verify_groups(run_id, [gid for gid, _ in apart], [attempt for _, attempt in apart])
    statuses = verification.verify_groups([gid for gid in group_ids if gid in together], holder=this_worker())
    return ",".join(statuses)


@app.task(name="workers.tasks.verify.verify_group", ignore_result=True)
def verify_group(group_id: int) -> str:
    """Judge every pending sample of a group; when all are judged, the group joins the ready buffer."""
    return verification.verify_group(group_id, holder=this_worker())


@app.task(name="workers.tasks.verify.score_evaluation", ignore_result=True)
def score_evaluation(run_id: int, version: int, samples: int) -> dict[str, float]:
    """Held-out evaluation, the judging half."""
    return heldout.score(run_id, version, samples)


@app.task(name="workers.tasks.verify.calibrate_verifier")
def calibrate_verifier(report_id: int) -> str:
    """Run the calibration of a pending report. Idempotent: a report already claimed is left alone."""
    if not CalibrationReport.objects.filter(pk=report_id, status=CalibrationReport.Status.PENDING).update(
            status=CalibrationReport.Status.RUNNING):
        return "already claimed"
    report = do_run_calibration(CalibrationReport.objects.select_related("verifier").get(pk=report_id))
    return "error" if report.error else ("passed" if report.passed else "failed")
