"""CPU work off the event loop: a large request's fingerprint runs in a worker thread.

Fingerprinting counts tokens per segment or chunk (tiktoken, which releases the GIL while
it encodes) and walks every message in Python, which the interpreter preempts every few
milliseconds: run in a thread, a prompt of hundreds of thousands of messages no longer
stalls every other client for seconds. Small requests (under ``OFFLOAD_BYTES``) stay on the
loop, where a thread hop would cost more than the work. ``WORKERS`` bounds the threads: more
large requests than that wait their turn in the pool's queue.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
OFFLOAD_BYTES = 256 * 1024  # a body at least this large is fingerprinted in a worker thread
WORKERS = 2  # worker threads (the GIL shares one core among them and the loop anyway)


class Offload:
    def __init__(self, threshold: int = OFFLOAD_BYTES, workers: int = WORKERS) -> None:
        self._threshold = threshold
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="fingerprint")
        self.threads: set[int] = set()  # the threads that ran work (observability, tests)

    async def run(self, size: int, work: Callable[[], T]) -> T:
        """``work()``: in a worker thread when ``size`` (the body's bytes) is large."""
        if size < self._threshold:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, work)

    def _call(self, work: Callable[[], T]) -> T:
        self.threads.add(threading.get_ident())
        return work()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
