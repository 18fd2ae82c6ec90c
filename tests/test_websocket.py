"""The run websocket: owners only; metric batches arrive with sequence numbers through the channel layer."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator

from tests import factories
from webapp.runs.loop.live import emit
from webapp.runs.metrics import Point
from webapp.ui.routing import websocket_urlpatterns

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]


@pytest_asyncio.fixture(autouse=True)
async def close_thread_connections():
    """sync_to_async runs the ORM in a worker thread; close its connection so the test DB can be dropped."""
    yield
    from django.db import connections

    await sync_to_async(connections.close_all)()


def communicator(run_id: int, user=None) -> WebsocketCommunicator:
    app = URLRouter(websocket_urlpatterns)
    comm = WebsocketCommunicator(app, f"/ws/runs/{run_id}/")
    comm.scope["user"] = user
    return comm


async def test_owner_receives_metrics_with_sequence_numbers(redis_url, user):
    run = await sync_to_async(factories.run)(user)
    comm = communicator(run.pk, user)
    connected, _ = await comm.connect()
    assert connected
    assert await comm.receive_json_from(timeout=5) == {"type": "hello", "run": run.pk}
    await sync_to_async(emit)(run.pk, [Point("reward", 1, 0.25), Point("loss", 1, 2.0)])
    message = await comm.receive_json_from(timeout=5)
    assert message["type"] == "metrics" and (message["first_seq"], message["last_seq"]) == (1, 2)
    assert [p[0] for p in message["points"]] == ["reward", "loss"]
    await sync_to_async(emit)(run.pk, [Point("reward", 2, 0.5)])
    assert (await comm.receive_json_from(timeout=5))["first_seq"] == 3
    await comm.disconnect()


async def test_an_idle_socket_stays_open_past_the_redis_read_timeout(redis_url, user):
    """Nothing to send for longer than redis-py 8's default read timeout (5 s): the consumer keeps waiting
    (with that default its channel-layer receive raised TimeoutError and the socket closed)."""
    run = await sync_to_async(factories.run)(user)
    comm = communicator(run.pk, user)
    connected, _ = await comm.connect()
    assert connected
    assert await comm.receive_json_from(timeout=5) == {"type": "hello", "run": run.pk}
    await asyncio.sleep(7)
    assert await comm.receive_nothing(timeout=0.1)
    await sync_to_async(emit)(run.pk, [Point("reward", 1, 0.25)])
    assert (await comm.receive_json_from(timeout=5))["type"] == "metrics"
    await comm.disconnect()


async def test_other_users_and_anonymous_are_refused(redis_url, user, other_user):
    from django.contrib.auth.models import AnonymousUser

    run = await sync_to_async(factories.run)(user)
    for who in (other_user, AnonymousUser(), None):
        comm = communicator(run.pk, who)
        connected, code = await comm.connect()
        assert not connected and code == 4403
