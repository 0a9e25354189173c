"""Several proxy replicas in-process on one fresh redis-server, for ``bench.replay
--replicas N``: each request goes to the next replica in turn, as the compose file's nginx
spreads them, so a session's turns alternate replicas."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

from bench.inproc import serve
from proxy.config import Settings
from tests.real.stack import RedisServer


@asynccontextmanager
async def serve_replicas(settings: Settings, count: int) -> AsyncIterator[Callable[[], str]]:
    """``async with serve_replicas(settings, 2) as next_url``: the base URL for each request."""
    redis = RedisServer().start()
    try:
        shared = Settings.model_validate({**settings.model_dump(), "redis_url": redis.url})
        async with AsyncExitStack() as stack:
            urls = [await stack.enter_async_context(serve(shared)) for _ in range(count)]
            turn = itertools.count()
            yield lambda: urls[next(turn) % count]
    finally:
        redis.stop()
