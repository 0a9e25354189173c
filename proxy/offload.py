"""CPU work off the event loop: a large body is parsed, fingerprinted and encoded in a worker
thread, and only a few large bodies are worked on at once.

Decoding JSON, fingerprinting (tiktoken, which releases the GIL while it encodes, and a walk
of every message in Python, which the interpreter preempts every few milliseconds) and
encoding the forwarded body take time in proportion to a body's size: in a thread, a prompt
of hundreds of thousands of messages no longer stalls every other client for seconds. Small
bodies (under ``OFFLOAD_BYTES``, measured by the bytes read, so a chunked upload counts too)
stay on the loop, where a thread hop would cost more than the work. ``WORKERS`` bounds the
threads: more work than that waits its turn in the pool's queue.

A parsed body takes several times its bytes in memory, so ``admitted`` lets at most
``LARGE_BODIES`` large bodies at a time through parsing and routing; the next waits for one
of them to be done (its bytes are already read: each at most ``max_body_bytes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
_FREE: contextlib.AbstractAsyncContextManager[object] = contextlib.nullcontext()
OFFLOAD_BYTES = 256 * 1024  # a body at least this large is worked on in a worker thread
WORKERS = 2  # worker threads (the GIL shares one core among them and the loop anyway)
LARGE_BODIES = 2  # requests: large bodies parsed and routed at once (as many as WORKERS)


class Offload:
    def __init__(
        self, threshold: int = OFFLOAD_BYTES, workers: int = WORKERS, bodies: int = LARGE_BODIES
    ) -> None:
        self._threshold = threshold
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="offload")
        self._bodies = asyncio.Semaphore(bodies)
        self.threads: set[int] = set()  # the threads that ran work (observability, tests)

    def large(self, size: int) -> bool:
        return size >= self._threshold

    async def run(self, size: int, work: Callable[[], T]) -> T:
        """``work()``: in a worker thread when ``size`` (the body's bytes) is large."""
        if not self.large(size):
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, work)

    def admitted(self, size: int) -> contextlib.AbstractAsyncContextManager[object]:
        """Holds one of the ``LARGE_BODIES`` places while a large body is worked on."""
        return self._bodies if self.large(size) else _FREE

    def _call(self, work: Callable[[], T]) -> T:
        self.threads.add(threading.get_ident())
        return work()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
