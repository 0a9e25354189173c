"""The token counter's memo of raw-prompt chunk blocks (``TokenCounter.blocks``)."""

from __future__ import annotations

import tracemalloc
from typing import Any

from proxy.core.prompt.raw_blocks import fingerprint_text, fingerprint_tokens
from proxy.routing import tokenizer
from proxy.routing.tokenizer import TokenCounter


def test_chunk_blocks_are_encoded_once_and_the_memo_is_bounded(monkeypatch: Any) -> None:
    counter = TokenCounter()
    calls: list[str] = []
    encode = counter.encode

    def counted(text: str) -> list[int]:
        calls.append(text)
        return encode(text)

    monkeypatch.setattr(counter, "encode", counted)
    text = "the quick brown fox jumps over the lazy dog. " * 200  # 9000 characters: 5 chunks
    fp = fingerprint_text(text, lambda at, part: counter.blocks(at, part, 16))
    assert len(calls) == 5
    assert fingerprint_text(text, lambda at, part: counter.blocks(at, part, 16)) == fp
    assert len(calls) == 5
    first = calls[0]  # a chunk's blocks are those of its own tokens
    assert (
        fp.hashes[: len(encode(first)) // 16]
        == fingerprint_tokens(encode(first), 16).hashes[: len(encode(first)) // 16]
    )
    budget = sum(size for _, size in list(counter._blocks._entries.values())[-3:])
    bounded = TokenCounter(chunk_bytes=budget)
    fingerprint_text(text, lambda at, part: bounded.blocks(at, part, 16))
    assert 0 < bounded.accounted <= budget
    assert len(bounded._blocks) == 3  # the newest chunks


def test_the_count_memo_keeps_digests_within_its_byte_budget(monkeypatch: Any) -> None:
    """Distinct megabyte texts: the memo accounts a bounded number of bytes and keeps none
    of the texts (it is keyed by their digests)."""
    budget = 50 * tokenizer.ENTRY_BYTES
    counter = TokenCounter(count_bytes=budget)
    monkeypatch.setattr(counter, "encode", lambda text: [0] * (len(text) % 7))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200):
            text = f"{i:08d}" + "x" * (1024 * 1024)
            assert counter.count(text) == len(text) % 7
            assert counter.accounted <= budget
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(counter._cache) == 50
    assert held < 4 * 1024 * 1024  # the last text, not the 200 MiB of them
    assert counter.count("00000199" + "x" * (1024 * 1024)) == (8 + 1024 * 1024) % 7
    assert counter.unknown(["00000000" + "x" * (1024 * 1024)])  # the oldest went first


async def test_the_backend_is_asked_until_it_fails_once() -> None:
    """A backend that cannot count (slow past the probe timeout, or gone) costs a request one
    failed call, not one per new message; the texts left are asked for again next time."""
    counter, asked = TokenCounter(), []

    async def failing(text: str) -> int | None:
        asked.append(text)
        return None

    await counter.prepare(["a b", "c d", "e f"], failing)
    assert asked == ["a b"]

    async def counting(text: str) -> int | None:
        asked.append(text)
        return 7

    await counter.prepare(["a b", "c d", "e f"], counting)
    assert asked == ["a b", "a b", "c d", "e f"]
    assert counter.unknown(["a b", "c d", "e f"]) == []
