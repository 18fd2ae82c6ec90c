"""Real Celery workers over the real Redis broker: every queue answers, and a run is advanced by a worker."""

from __future__ import annotations

import time

import pytest
from celery.exceptions import TimeoutError as CeleryTimeoutError

from tests import factories
from webapp.runs.models import Run
from workers.celery import QUEUES, app
from workers.tasks.health import ping, ping_all

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_celery_configuration():
    conf = app.conf
    assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.worker_prefetch_multiplier == 1
    assert {q.name for q in conf.task_queues} == set(QUEUES)
    assert app.amqp.router.route({}, "workers.tasks.verify.calibrate_verifier")["queue"].name == "verify"
    assert app.amqp.router.route({}, "workers.tasks.control.advance_run")["queue"].name == "control"


def test_every_queue_round_trips_through_a_real_worker(start_worker):
    worker = start_worker(",".join(QUEUES))
    answers = ping_all(timeout=20)
    assert set(answers) == set(QUEUES)
    assert {a["pid"] for a in answers.values()} == {worker.proc.pid}
    assert all(answers[q]["pong"] == q for q in QUEUES)


def test_a_queue_without_a_worker_gets_no_answer(start_worker):
    start_worker("control")
    result = ping.apply_async(args=["x"], queue="train")
    with pytest.raises(CeleryTimeoutError):
        result.get(timeout=2)
    result.revoke()
    app.control.purge()


def test_start_and_pause_are_carried_out_by_the_control_worker(start_worker, api, user):
    start_worker("control")
    run = factories.run(user)
    assert api.post(f"/api/v1/runs/{run.pk}/start/", {}, format="json").json()["status"] == "queued"
    deadline = time.monotonic() + 20
    while Run.objects.get(pk=run.pk).status != "running":
        assert time.monotonic() < deadline, "the control worker never moved the run to running"
        time.sleep(0.1)
    assert api.post(f"/api/v1/runs/{run.pk}/pause/", {}, format="json").json()["status"] == "pausing"
    while Run.objects.get(pk=run.pk).status != "paused":
        assert time.monotonic() < deadline + 20, "the control worker never finished the pause"
        time.sleep(0.1)
    kinds = list(Run.objects.get(pk=run.pk).events.values_list("kind", flat=True))
    assert kinds == ["created", "status.queued", "status.running", "status.pausing", "status.paused"]
