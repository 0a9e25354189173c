from __future__ import annotations

import tracemalloc

from proxy.core.disk.quota import BUCKETS, MAX_CLIENTS, OVERFLOW, WriteQuota


def save(quota: WriteQuota, client: str, nbytes: int, now: float) -> bool:
    """A save of ``nbytes`` that completes before the next one starts."""
    key = quota.reserve(client, nbytes, now)
    if key is not None:
        quota.settle(key, nbytes, nbytes, now)
    return key is not None


def test_a_client_over_its_cap_waits_for_old_writes_to_leave_the_window() -> None:
    quota = WriteQuota(limit=1000, window=60.0)
    assert save(quota, "a", 600, 0.0)
    assert save(quota, "a", 600, 10.0)  # the save that crosses the cap was allowed
    assert quota.reserve("a", 1, 20.0) is None
    assert quota.reserve("b", 1, 20.0) == "b"  # per client
    assert quota.reserve("a", 1, 59.0) is None
    assert quota.reserve("a", 1, 60.5) == "a"  # the first write left the window: 600 < 1000


def test_saves_in_flight_count_against_each_other() -> None:
    quota = WriteQuota(limit=1000, window=60.0)
    first = quota.reserve("a", 600, 0.0)
    second = quota.reserve("a", 600, 0.0)  # crosses the cap: allowed
    assert first == second == "a"
    assert quota.reserve("a", 600, 0.0) is None  # 1200 in flight
    quota.settle("a", 600, 0, 1.0)  # the first failed: nothing written
    quota.settle("a", 600, 300, 1.0)  # the second wrote less than estimated
    assert quota.reserve("a", 600, 2.0) == "a"  # 300 written, 600 in flight
    assert quota.reserve("a", 100, 2.0) == "a"
    assert quota.reserve("a", 100, 2.0) is None  # 300 + 700 in flight


def test_no_cap_and_idle_clients_are_forgotten() -> None:
    unlimited = WriteQuota(limit=0, window=60.0)
    assert save(unlimited, "a", 10**12, 0.0)
    assert unlimited.reserve("a", 10**12, 0.0) == "a"
    quota = WriteQuota(limit=1000, window=10.0)
    for i in range(100):
        save(quota, f"client{i}", 2000, 100.0)
    save(quota, "late", 1, 120.0)  # a window later: the idle logs are dropped
    assert set(quota._logs) == {"late"}


def test_a_new_identity_per_request_shares_one_bounded_log() -> None:
    quota = WriteQuota(limit=10**9, window=60.0)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(MAX_CLIENTS + 5000):  # a random token per request, all within the window
        now = i * 60.0 / (MAX_CLIENTS + 5000)
        for k in range(2):
            assert save(quota, f"token{i}", 100, now + k * 60.0 / BUCKETS)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(quota._logs) == MAX_CLIENTS + 1
    assert len(quota._logs[OVERFLOW]) <= BUCKETS + 1
    assert used < 16 * 2**20
    capped = WriteQuota(limit=1000, window=60.0)
    for i in range(MAX_CLIENTS):
        save(capped, f"token{i}", 1, 0.0)
    assert save(capped, "new1", 1000, 1.0)  # the table is full: new clients share a cap
    assert capped.reserve("new2", 1, 2.0) is None


def test_writes_close_in_time_share_a_record() -> None:
    quota = WriteQuota(limit=10**9, window=160.0)
    for second in range(1000):
        save(quota, "a", 1, float(second))
    log = quota._logs["a"]
    assert len(log) <= BUCKETS + 1
    assert sum(n for _, n in log) >= 160 - 10  # the window's writes, give or take a record
