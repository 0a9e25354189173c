from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from proxy.core.prompt.fingerprint import chat_segments, fingerprint_chat, fingerprint_segments
from proxy.core.routing.churn import divergence, message_bucket, sketch
from proxy.metrics import ProxyMetrics
from proxy.routing.churn_tracker import ChurnTracker


def words(text: str) -> int:
    return len(text.split())


def sk(body: dict[str, Any]) -> Any:
    return sketch(fingerprint_chat(body, words), chat_segments(body))


def body(system: str, *turns: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    messages += [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)
    ]
    return {"messages": messages}


def test_an_extending_turn_is_not_churn() -> None:
    old = sk(body("rules", "q1"))
    assert divergence("s", old, sk(body("rules", "q1", "a1", "q2")), 0.0) is None


def test_a_timestamp_in_the_system_prompt_is_found_with_both_sides() -> None:
    old = sk(body("You are helpful. Current time: 09:12:36. " + "rule " * 50, "q1"))
    new = sk(body("You are helpful. Current time: 09:13:10. " + "rule " * 50, "q1", "a1", "q2"))
    found = divergence("s", old, new, 5.0)
    assert found is not None
    assert (found.message_index, found.role) == (0, "system")
    assert found.token_offset == 0
    assert found.tokens_lost == old.fp.total
    assert "09:12:36" in found.before
    assert "09:13:10" in found.after


def test_a_dropped_transient_last_message_loses_only_its_tokens() -> None:
    old = sk(body("rules " * 50, "q1", "a1", "transient status line"))
    new = sk(body("rules " * 50, "q1", "a1", "q2"))
    found = divergence("s", old, new, 0.0)
    assert found is not None
    assert found.message_index == 3
    assert found.tokens_lost < 10


def test_message_buckets_are_bounded() -> None:
    assert [message_bucket(i) for i in (-1, 0, 9, 10, 500)] == ["preamble", "0", "9", "10+", "10+"]


def test_the_tracker_keeps_sketches_within_its_byte_budget() -> None:
    """Sessions of many-message prompts: the sketches kept stay within the budget, the newest
    kept (a count of sessions alone would keep 2000 of them, ~0.7 MB each here)."""
    budget = 4 * 1024 * 1024
    tracker = ChurnTracker(ProxyMetrics(CollectorRegistry()), lambda: 0.0, budget=budget)
    for session in range(40):
        prompt = body("rules", *(f"turn {i} " + "x" * 300 for i in range(2000)))
        segments = chat_segments(prompt)
        tracker.observe(f"s{session}", fingerprint_segments(segments, words), prompt, segments)
        assert tracker.accounted <= budget
    assert 0 < tracker.status()["sessions_tracked"] < 40
    assert "key:s39" in tracker._sketches


def test_the_tracker_keeps_the_sessions_that_lost_the_most_within_a_bound() -> None:
    """Every session that ever diverged had its counters kept for good (12,000 sessions:
    12,000 entries, 12.8 MB)."""
    tracker = ChurnTracker(ProxyMetrics(CollectorRegistry()), lambda: 0.0, sessions=10)
    for session in range(100):
        for system in ("rules v1 " + "x " * session, "rules v2"):  # the system prompt churns
            prompt = body(system, "hello")
            segments = chat_segments(prompt)
            tracker.observe(f"s{session}", fingerprint_segments(segments, words), prompt, segments)
    assert len(tracker._lost) <= 20
    assert len(tracker._count) <= 20
    top = tracker.status(text=True)["top_sessions"][0]
    assert top["session"] == "key:s99"  # its system prompt lost the most
