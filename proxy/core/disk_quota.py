"""Per-client cap on disk writes: the snapshot bytes one client's requests may write in a
sliding window of time.

A client is the identity the proxy already derives for tenants (``core.isolation.tenant_of``:
a hash of its API key, or of the configured tenant header; clients without one share the
``anonymous`` identity). Each client has a log of (time, bytes) of the snapshots its
requests wrote: scoped and full saves (a park is written by the operator's policy for the
session being evicted, not for the request, and is not charged). A save is allowed while
the bytes logged in the last ``window`` seconds are under ``limit``; the save that crosses
the limit is allowed (a file's size is known only once written), later ones are skipped
until old writes leave the window. ``limit`` 0: no cap. Each replica counts its own writes.

Memory: a log holds only writes inside the window, and logs left empty are dropped (at
most once per window, so each call stays O(1) amortized).
"""

from __future__ import annotations

from collections import deque


class WriteQuota:
    def __init__(self, limit: int, window: float) -> None:
        self.limit = limit  # bytes per window; 0 = no cap
        self.window = window  # seconds
        self._logs: dict[str, deque[tuple[float, int]]] = {}
        self._pruned = 0.0

    def allows(self, client: str, now: float) -> bool:
        """Whether ``client`` may write another snapshot now."""
        if self.limit <= 0:
            return True
        log = self._logs.get(client)
        if log is None:
            return True
        self._expire(log, now)
        return sum(n for _, n in log) < self.limit

    def charge(self, client: str, nbytes: int, now: float) -> None:
        """Record a snapshot of ``nbytes`` written for ``client``."""
        if self.limit <= 0:
            return
        self._logs.setdefault(client, deque()).append((now, nbytes))
        if now - self._pruned >= self.window:
            self._pruned = now
            for name, log in list(self._logs.items()):
                self._expire(log, now)
                if not log:
                    del self._logs[name]

    def _expire(self, log: deque[tuple[float, int]], now: float) -> None:
        while log and log[0][0] <= now - self.window:
            log.popleft()
