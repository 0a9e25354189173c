"""Per-client cap on disk writes: the snapshot bytes one client's requests may write in a
sliding window of time.

A client is the identity the proxy already derives for tenants (``core.prompt.isolation.tenant_of``:
a hash of its API key, or of the configured tenant header; clients without one share the
``anonymous`` identity). The cap binds a client only if it cannot pick a new identity at
will: with the proxy's ``api_key`` set, every accepted key is one of the operator's.

Each client has a log of (time, bytes) of the snapshots its requests wrote (scoped and
full saves; a park is written by the operator's policy for the session being evicted, not
for the request, and is not charged) and the bytes of its saves in flight. A save first
``reserve``s its estimated size: it is allowed while the logged bytes in the last
``window`` seconds plus those in flight are under ``limit`` (the save that crosses the
limit is allowed: a file's size is known only once written), so saves that run at once
count against each other. ``settle`` then replaces the estimate with the bytes written (0
for a failed save). ``limit`` 0: no cap. Each replica counts its own writes.

Memory is bounded. A client's writes are logged in at most ``BUCKETS`` records per window
(writes within ``window / BUCKETS`` seconds of a record's time add to it, so they leave
the window up to that much early). At most ``MAX_CLIENTS`` clients are logged; while the
table is full, new clients share one ``OVERFLOW`` log and cap. Logs left empty are dropped
(at most once per window, so each call stays O(1) amortized).
"""

from __future__ import annotations

from collections import deque

BUCKETS = 16  # records per client and window
MAX_CLIENTS = 4096  # clients logged at once (beyond: they share OVERFLOW)
OVERFLOW = "overflow"


class WriteQuota:
    def __init__(self, limit: int, window: float) -> None:
        self.limit = limit  # bytes per window; 0 = no cap
        self.window = window  # seconds
        self._logs: dict[str, deque[tuple[float, int]]] = {}
        self._pending: dict[str, int] = {}  # client -> bytes reserved by saves in flight
        self._pruned = 0.0

    def reserve(self, client: str, nbytes: int, now: float) -> str | None:
        """Reserve ``nbytes`` for a save by ``client``: the key to ``settle`` it with, or
        None when the client is over its cap (nothing reserved)."""
        if self.limit <= 0:
            return client
        self._prune(now)
        if client not in self._logs and len(self._logs) >= MAX_CLIENTS:
            client = OVERFLOW
        log = self._logs.setdefault(client, deque())
        self._expire(log, now)
        pending = self._pending.get(client, 0)
        if sum(n for _, n in log) + pending >= self.limit:
            return None
        self._pending[client] = pending + nbytes
        return client

    def settle(self, key: str, reserved: int, written: int, now: float) -> None:
        """A save reserved under ``key`` ended: ``written`` bytes (0 if it failed)."""
        if self.limit <= 0:
            return
        pending = self._pending.pop(key, 0) - reserved
        if pending > 0:
            self._pending[key] = pending
        if written <= 0:
            return
        log = self._logs.setdefault(key, deque())
        if log and log[-1][0] > now - self.window / BUCKETS:
            log[-1] = (log[-1][0], log[-1][1] + written)
        else:
            log.append((now, written))

    def _prune(self, now: float) -> None:
        if now - self._pruned < self.window:
            return
        self._pruned = now
        for name, log in list(self._logs.items()):
            self._expire(log, now)
            if not log and name not in self._pending:
                del self._logs[name]

    def _expire(self, log: deque[tuple[float, int]], now: float) -> None:
        while log and log[0][0] <= now - self.window:
            log.popleft()
