"""The channel layer: channels_redis's, with a blocking pop shorter than redis-py's read timeout.

redis-py 8 gives every connection a 5 s socket (read) timeout by default. channels_redis 4.3 receives with
``BZPOPMIN`` blocking for up to ``brpop_timeout`` = 5 s, so on an idle channel the read timed out first: the
consumer of every websocket with nothing to send for 5 s died with ``TimeoutError: Timeout reading`` and the
page reconnected (measured on a reasoning-gym run whose steps take longer than that). Popping for at most
2 s keeps each read well inside the timeout; an idle socket costs one round trip to Redis every 2 s.

Raising the read timeout instead (``socket_timeout`` in the host's options) fixed the crash, but a consumer
cancelled mid-read (a refused or closed socket) then stayed blocked in it: tests/test_websocket.py hung.
"""

from __future__ import annotations

from channels_redis.core import RedisChannelLayer


class ChannelLayer(RedisChannelLayer):
    brpop_timeout = 2
