"""Run health: the pure alert rules, alerts raised once and cleared on the run's event log (API and
websocket), auto-pause on collapse, and worker heartbeats from real Celery workers."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from tests import factories
from webapp.runs.loop.alerts import check_run as check_run_health
from webapp.runs.metrics import Point, record_points
from webapp.runs.models import PromptGroup, Run, RunStatus, WorkerHeartbeat
from workers.pipeline.alerts import Bounds, HealthFacts, StepFacts, WorkerFacts, changes, check

ALL_LIVE = tuple(WorkerFacts(f"w-{q}", (q,), silent_s=1.0) for q in ("control", "rollout", "train", "verify"))


SHORT_WINDOW = Bounds(collapse_window=3)


def keys(facts: HealthFacts, bounds: Bounds = SHORT_WINDOW) -> set[str]:
    return {a.key for a in check(facts, bounds)}


# --- the rules, pure -------------------------------------------------------------------------------


def test_a_healthy_run_raises_nothing():
    steps = [StepFacts(s, zero_variance_share=0.5, staleness_max=1.0) for s in range(1, 6)]
    assert keys(HealthFacts(steps=steps, judged=200, invalid_share=0.01, stage_age_s={"verify": 3.0},
                            workers=ALL_LIVE)) == set()


def test_collapse_needs_every_step_of_the_window_without_signal_or_a_nonfinite_loss():
    flat = [StepFacts(s, zero_variance_share=1.0) for s in range(1, 4)]
    assert "collapse" in keys(HealthFacts(steps=flat, workers=ALL_LIVE))
    assert "collapse" not in keys(HealthFacts(steps=flat[1:], workers=ALL_LIVE))  # window not full yet
    mixed = [*flat[:2], StepFacts(3, zero_variance_share=0.9)]
    assert "collapse" not in keys(HealthFacts(steps=mixed, workers=ALL_LIVE))
    nan = [StepFacts(1, zero_variance_share=0.2, nonfinite=True)]
    [alert] = check(HealthFacts(steps=nan, workers=ALL_LIVE), Bounds())
    assert alert.kind == "alert.collapse" and alert.level == "error" and "non-finite" in alert.message


def test_stall_invalid_rate_and_staleness_bounds():
    facts = HealthFacts(stage_age_s={"generate": 5.0, "verify": 400.0}, judged=50, invalid_share=0.5,
                        steps=[StepFacts(7, staleness_max=3.0)], workers=ALL_LIVE)
    assert keys(facts, Bounds(stall_seconds=300, max_invalid_rate=0.2, staleness=2)) == {
        "stall.verify", "invalid_rate", "staleness"}
    # few verdicts say nothing yet; many groups dropped as too stale is staleness too
    assert keys(HealthFacts(judged=5, invalid_share=1.0, stale_dropped=40, workers=ALL_LIVE),
                Bounds(stale_drops=16)) == {"staleness"}


def test_silent_workers_and_uncovered_queues():
    workers = (*ALL_LIVE[:3], WorkerFacts("sandbox@h", ("verify",), silent_s=90.0),
               WorkerFacts("old@h", ("verify",), silent_s=9000.0, seen_during_run=False),
               WorkerFacts("stopped@h", ("rollout",), silent_s=500.0, stopped=True))
    alerts = {a.key: a for a in check(HealthFacts(workers=workers), Bounds(silent_seconds=30))}
    assert set(alerts) == {"worker_gone:sandbox@h", "no_worker:verify"}
    assert alerts["worker_gone:sandbox@h"].level == "warning" and alerts["no_worker:verify"].level == "error"


def test_changes_raise_new_alerts_once_and_clear_recovered_ones():
    now = check(HealthFacts(judged=100, invalid_share=0.9, workers=ALL_LIVE), Bounds())
    raised, cleared = changes({}, now)
    assert [a.key for a in raised] == ["invalid_rate"] and cleared == []
    assert changes({"invalid_rate": {}}, now) == ([], [])
    assert changes({"invalid_rate": {}}, []) == ([], ["invalid_rate"])


# --- on a run: the event log, the API, the websocket -----------------------------------------------


def running_run(user, **spec):
    run = factories.run(user)
    Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, started_at=timezone.now() - timedelta(hours=1),
                                         spec={**run.spec, **spec})
    return Run.objects.get(pk=run.pk)


def live_workers():
    now = timezone.now()
    for q in ("control", "rollout", "train", "verify"):
        WorkerHeartbeat.objects.create(name=f"{q}@h", queues=q, pid=1, started_at=now, last_seen=now)


def steps(run, first, last, share):
    record_points(run.pk, [p for s in range(first, last + 1)
                           for p in (Point("zero_variance_share", s, share), Point("nonfinite", s, 0.0))])
    Run.objects.filter(pk=run.pk).update(step=last)


@pytest.mark.django_db
def test_a_collapse_is_logged_once_and_its_recovery_too(user, api):
    run = running_run(user, collapse_window=3)
    live_workers()
    steps(run, 1, 3, 1.0)
    assert check_run_health(run.pk) == ["collapse"]
    assert check_run_health(run.pk) == ["collapse"]  # no second event
    events = api.get(f"/api/v1/runs/{run.pk}/events/").json()
    alerts = [e for e in events if e["kind"].startswith("alert.")]
    assert [(e["kind"], e["level"], e["data"]["key"]) for e in alerts] == [("alert.collapse", "error", "collapse")]
    assert "identical" in alerts[0]["message"]
    steps(run, 4, 4, 0.25)
    assert check_run_health(run.pk) == []
    kinds = [e["kind"] for e in api.get(f"/api/v1/runs/{run.pk}/events/").json()]
    assert kinds[-2:] == ["alert.collapse", "alert.collapse.cleared"]
    assert Run.objects.get(pk=run.pk).state["alerts"] == {}


@pytest.mark.django_db
def test_auto_pause_on_collapse(user):
    run = running_run(user, collapse_window=2, auto_pause_on_collapse=True)
    live_workers()
    steps(run, 1, 2, 1.0)
    check_run_health(run.pk)
    run.refresh_from_db()
    assert run.status == "pausing" and "collapsed" in run.status_reason
    assert list(run.events.values_list("kind", flat=True))[-2:] == ["alert.collapse", "status.pausing"]


@pytest.mark.django_db
def test_a_stalled_stage_and_a_missing_worker(user):
    run = running_run(user, stall_alert_seconds=60)
    WorkerHeartbeat.objects.create(name="control@h", queues="control,rollout,train", pid=1,
                                   started_at=timezone.now(), last_seen=timezone.now())
    group = PromptGroup.objects.create(run=run, key="g", status="verifying")
    PromptGroup.objects.filter(pk=group.pk).update(updated_at=timezone.now() - timedelta(seconds=120))
    assert check_run_health(run.pk) == ["no_worker:verify", "stall.verify"]
    event = run.events.get(kind="alert.stall")
    assert event.level == "warning" and event.data["stage"] == "verify" and "verification stalled" in event.message


def listen_to(run: Run) -> Callable[[], dict[str, Any]]:
    """Join the run page's channel-layer group; the returned function waits (5 s at most) for the next payload."""
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(f"run.{run.pk}", channel)
    return lambda: async_to_sync(asyncio.wait_for)(layer.receive(channel), 5)["payload"]


@pytest.mark.django_db(transaction=True)
def test_alerts_are_broadcast_to_the_run_page(user, redis_url):
    run = running_run(user)
    receive = listen_to(run)
    check_run_health(run.pk)  # no worker at all: one alert per queue
    seen = set()
    for _ in range(4):
        payload = receive()
        assert payload["type"] == "event" and payload["event"]["kind"] == "alert.no_worker"
        seen.add(payload["event"]["data"]["queue"])
    assert seen == {"control", "rollout", "train", "verify"}


# --- heartbeats of real workers --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_silent_worker_is_flagged_on_the_run(start_worker, user, api, monkeypatch):
    run = running_run(user)
    start_worker("control,rollout,train", TEMPER_HEARTBEAT_SECONDS="0.5")
    verify = start_worker("verify", TEMPER_HEARTBEAT_SECONDS="0.5")
    deadline = time.monotonic() + 10
    while WorkerHeartbeat.objects.count() < 2:  # the first beat is written by a thread once the worker is up
        assert time.monotonic() < deadline, list(WorkerHeartbeat.objects.values_list("name", flat=True))
        time.sleep(0.1)
    names = dict(WorkerHeartbeat.objects.values_list("queues", "name"))
    assert set(names) == {"control,rollout,train", "verify"}
    beat = WorkerHeartbeat.objects.get(name=names["verify"])
    assert beat.pid == verify.proc.pid and beat.stopped_at is None
    time.sleep(1.2)
    assert WorkerHeartbeat.objects.get(pk=beat.pk).last_seen > beat.last_seen  # it keeps beating
    assert check_run_health(run.pk) == []
    os.killpg(verify.proc.pid, signal.SIGKILL)
    verify.proc.wait(10)
    monkeypatch.setenv("TEMPER_WORKER_SILENT_SECONDS", "2")
    time.sleep(2.5)
    assert check_run_health(run.pk) == ["no_worker:verify", f"worker_gone:{names['verify']}"]
    events = {e["kind"]: e for e in api.get(f"/api/v1/runs/{run.pk}/events/").json()}
    assert events["alert.worker_gone"]["data"]["worker"] == names["verify"]
    assert events["alert.worker_gone"]["level"] == "warning"
    # the replacement (same node name) clears both alerts
    start_worker("verify", TEMPER_HEARTBEAT_SECONDS="0.5")
    deadline = time.monotonic() + 10
    while check_run_health(run.pk) != []:
        assert time.monotonic() < deadline, check_run_health(run.pk)
        time.sleep(0.2)
    assert {"alert.worker_gone.cleared", "alert.no_worker.cleared"} <= set(run.events.values_list("kind", flat=True))


@pytest.mark.django_db(transaction=True)
def test_status_changes_are_broadcast_as_run_and_event_messages(user, redis_url):
    from webapp.runs.services import do_pause_run

    run = running_run(user)
    receive = listen_to(run)
    do_pause_run(run, reason="for the test")
    messages = [receive() for _ in range(2)]
    by_type = {m["type"]: m for m in messages}
    assert by_type["event"]["event"]["kind"] == "status.pausing"
    assert by_type["run"] == {"type": "run", "status": "pausing", "status_reason": "for the test", "step": 0,
                              "latest_version": 0}
