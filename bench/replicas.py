"""Several proxy replicas in-process on one fresh redis-server, for ``bench.replay
--replicas N``: each request goes to the next replica in turn, as the compose file's nginx
spreads them, so a session's turns alternate replicas.

``--shard`` (a diagnostic, not a deployment): each replica gets its own part of the backends
(backend ``i`` to replica ``i mod N``, no shared state) and every turn of a session goes to
the replica of its session number, so each slot has one scheduler and no replica's waiters
compete with another's for it — what two replicas would reach if each backend's requests
were scheduled by one replica."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from contextvars import ContextVar

from bench.inproc import serve
from proxy.config.settings import Settings
from testbed.probes import until_listed
from testbed.stack import RedisServer


@asynccontextmanager
async def serve_replicas(settings: Settings, count: int) -> AsyncIterator[Callable[[], str]]:
    """``async with serve_replicas(settings, 2) as next_url``: the base URL for each request."""
    redis = RedisServer().start()
    try:
        secret = {"secret": "bench replicas' shared secret"}  # (they forward to each other)
        data = {**settings.model_dump(), "redis_url": redis.url, "replicas": secret}
        shared = Settings.model_validate(data)
        async with AsyncExitStack() as stack:
            urls = [await stack.enter_async_context(serve(shared)) for _ in range(count)]
            await until_listed(urls)  # replicas run for days, a replay lasts seconds
            turn = itertools.count()
            yield lambda: urls[next(turn) % count]
    finally:
        redis.stop()


@asynccontextmanager
async def serve_shards(
    settings: Settings, count: int, session: ContextVar[tuple[int, int]]
) -> AsyncIterator[Callable[[], str]]:
    """``--shard``: replica ``i`` routes backends ``i``, ``i + count``, ... on its own state;
    a request goes to the replica of its session (``session``: (session, turn) of the
    request being sent)."""
    base = settings.model_dump()
    backends = base["backends"]
    if len(backends) < count:
        raise SystemExit(f"--shard needs at least {count} backends for {count} replicas")
    async with AsyncExitStack() as stack:
        urls = []
        for i in range(count):
            part = Settings.model_validate({**base, "backends": backends[i::count]})
            urls.append(await stack.enter_async_context(serve(part)))
        yield lambda: urls[session.get()[0] % count]
