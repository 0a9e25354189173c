from __future__ import annotations

from proxy.core.disk_quota import WriteQuota


def test_a_client_over_its_cap_waits_for_old_writes_to_leave_the_window() -> None:
    quota = WriteQuota(limit=1000, window=60.0)
    assert quota.allows("a", 0.0)
    quota.charge("a", 600, 0.0)
    assert quota.allows("a", 1.0)
    quota.charge("a", 600, 1.0)  # the save that crosses the cap was allowed
    assert not quota.allows("a", 2.0)
    assert quota.allows("b", 2.0)  # per client
    assert not quota.allows("a", 59.0)
    assert quota.allows("a", 60.5)  # the first write left the window: 600 < 1000


def test_no_cap_and_idle_clients_are_forgotten() -> None:
    unlimited = WriteQuota(limit=0, window=60.0)
    unlimited.charge("a", 10**12, 0.0)
    assert unlimited.allows("a", 0.0)
    quota = WriteQuota(limit=1000, window=10.0)
    for i in range(100):
        quota.charge(f"client{i}", 2000, 0.0)
    quota.charge("late", 1, 20.0)  # a window later: the idle logs are dropped
    assert set(quota._logs) == {"late"}
