"""The reuse-rule probe's plan and verdict, and checkpoint reuse of chat contents."""

from __future__ import annotations

import pytest

from proxy.core.prompt.fingerprint import fingerprint_chat
from proxy.core.routing.scoring import predicted_reuse
from proxy.core.server.reuse_rules import (
    PROBE_SHARED,
    PROBE_TOKENS,
    Rule,
    checkpoint_reuse,
    classify,
    diverging,
    plan,
)
from proxy.core.server.slots import SlotState


def words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize(
    ("n_ctx", "expected"),
    [
        (0, (PROBE_TOKENS, PROBE_SHARED)),  # not reported: the full probe
        (8192, (PROBE_TOKENS, PROBE_SHARED)),
        (PROBE_TOKENS + 8, (PROBE_TOKENS, PROBE_SHARED)),
        (PROBE_TOKENS + 7, None),  # too small to put the divergence past n_ubatch
        (256, None),
    ],
)
def test_plan_fits_the_slot(n_ctx: int, expected: tuple[int, int] | None) -> None:
    assert plan(n_ctx) == expected


def test_probe_diverges_further_from_the_end_than_the_default_ubatch() -> None:
    assert PROBE_TOKENS - PROBE_SHARED > 512 + 4


@pytest.mark.parametrize(
    ("cache_n", "rule"),
    [
        (64, Rule.PREFIX),  # dense, or SWA with --swa-full: every shared token
        (58, Rule.PREFIX),
        (57, Rule.EXACT),
        (0, Rule.EXACT),  # SWA without --swa-full, hybrid, recurrent: no checkpoint before
    ],
)
def test_classify(cache_n: int, rule: Rule) -> None:
    assert classify(64, cache_n) is rule


def test_diverging_prompt() -> None:
    first = list(range(10))
    assert diverging(first, [100 + i for i in range(20)], 3) == [0, 1, 2, *range(100, 107)]
    assert diverging(first, [3, 4, 5, 6, 7, 8, 9], 3) is None  # would not diverge there
    assert diverging(first, [100, 101], 3) is None  # too short


@pytest.mark.parametrize(
    ("shared", "expected"), [(0, 0), (1, 0), (2, 2), (3, 2), (4, 4), (9, 4)], ids=str
)
def test_checkpoint_reuse_at_user_starts(shared: int, expected: int) -> None:
    assert checkpoint_reuse((2, 4), shared) == expected


SYSTEM = {"role": "system", "content": " ".join(["rules"] * 200)}


def chat(*texts: str) -> dict[str, object]:
    roles = ["user", "assistant"]
    turns = [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]
    return {"messages": [SYSTEM, *turns]}


def test_fingerprint_marks_user_messages() -> None:
    fp = fingerprint_chat(chat("hi", "hello", "more"), words)
    assert fp.users == (2, 4)  # preamble 0, system 1, user 2, assistant 3, user 4
    assert fp.extend([], words).users == fp.users


def test_exact_backend_reuses_the_system_prompt_through_a_checkpoint() -> None:
    """Another conversation with the same system prompt, on a slot of a checkpointing
    backend: the checkpoint at the slot's last user-message start serves the system prompt
    (was predicted 0: only an exact extension counted)."""
    a = fingerprint_chat(chat("question a " * 20), words)
    b = fingerprint_chat(chat("question b " * 20), words)
    slot = SlotState(0, content=a)
    assert predicted_reuse(b, slot, exact=True) == a.tokens_at(2) > 200
    assert predicted_reuse(b, slot, exact=False) == a.tokens_at(2)


def test_exact_backend_returning_turn_after_another_conversation() -> None:
    """A's next turn on a slot now holding B: only the shared, checkpointed prefix."""
    a2 = fingerprint_chat(chat("question a " * 20, "answer", "next"), words)
    b = fingerprint_chat(chat("question b " * 20), words)
    assert predicted_reuse(a2, SlotState(0, content=b), exact=True) == b.tokens_at(2)


def test_exact_backend_exact_extension_and_repeat() -> None:
    a = fingerprint_chat(chat("question a " * 20), words)
    a2 = fingerprint_chat(chat("question a " * 20, "answer", "next"), words)
    assert predicted_reuse(a2, SlotState(0, content=a), exact=True) == a.total  # extension
    # an exact repeat: back to the last user message's checkpoint
    assert predicted_reuse(a, SlotState(0, content=a), exact=True) == a.tokens_at(2)
