"""The run page's websocket: joins group ``run.<id>`` and forwards metric batches with sequence numbers.

Only the run's owner (or staff) may connect. Messages are the typed payloads of ``webapp.runs.loop.live``
through the channel layer; channels_redis may drop messages, so every batch carries sequence numbers
and the page backfills gaps over ``/api/v1/metrics/?since_seq=``.
"""

from __future__ import annotations

from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from webapp.runs.models import Run


def run_group(run_id: int) -> str:
    return f"run.{run_id}"


class RunConsumer(AsyncJsonWebsocketConsumer):
    run_id: int

    async def connect(self) -> None:
        user = self.scope.get("user")
        self.run_id = int(self.scope["url_route"]["kwargs"]["run_id"])
        if user is None or not user.is_authenticated or not await self._may_see(user):
            await self.close(code=4403)
            return
        await self.channel_layer.group_add(run_group(self.run_id), self.channel_name)
        await self.accept()
        await self.send_json({"type": "hello", "run": self.run_id})

    @database_sync_to_async
    def _may_see(self, user: Any) -> bool:
        return Run.objects.visible_to(user).filter(pk=self.run_id).exists()

    async def disconnect(self, code: int) -> None:
        if hasattr(self, "run_id"):
            await self.channel_layer.group_discard(run_group(self.run_id), self.channel_name)

    async def run_update(self, event: dict[str, Any]) -> None:
        """Forward a ``{"type": "run.update", "payload": {...}}`` group message to the browser."""
        await self.send_json(event["payload"])
