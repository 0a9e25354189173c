"""The token counter's memo of raw-prompt chunk blocks (``TokenCounter.blocks``)."""

from __future__ import annotations

from typing import Any

from proxy import tokenizer
from proxy.core.raw_blocks import fingerprint_text, fingerprint_tokens
from proxy.tokenizer import TokenCounter


def test_chunk_blocks_are_encoded_once_and_the_memo_is_bounded(monkeypatch: Any) -> None:
    counter = TokenCounter()
    calls: list[str] = []
    encode = counter.encode
    monkeypatch.setattr(counter, "encode", lambda text: calls.append(text) or encode(text))
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
    monkeypatch.setattr(tokenizer, "CHUNKS", 3)
    bounded = TokenCounter()
    fingerprint_text(text, lambda at, part: bounded.blocks(at, part, 16))
    assert len(bounded._blocks) == 3  # the newest chunks
