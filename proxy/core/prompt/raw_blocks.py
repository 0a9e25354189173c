"""Fingerprints of raw prompts (``/completion``, ``/v1/completions``, ``/infill``): fixed
blocks of ``block_tokens`` tokens, hashes chained as ``core.prompt.fingerprint``'s segments.

- *Text* is cut into ``CHUNK_CHARS``-character chunks first, by position only (prompts sharing
  a prefix share its whole chunks), and a chunk before each paragraph (a run of blank lines,
  ``paragraphs``); each piece is tokenized and blocked alone (its last block may be short):
  the caller memoizes a chunk's blocks by (chain hash before it, its text), so a 128k-token
  prompt whose prefix was seen encodes and hashes only its new tail.
  Agents that send raw prompts append a turn after a blank line, so a prompt continuing an
  earlier one shares all of it, not only its whole blocks (the RAM model needs that exact
  length).
- *Token ids* are used as given: packed once as 32-bit ids (which also tells a list of ids
  from any other list, counted as its text), then hashed in chunks of whole blocks, about
  ``CHUNK_IDS`` ids each, memoized by the caller by (chain hash before it, its packed ids):
  a prompt whose prefix was seen costs mostly the packing, a few times less than a Python
  type check of every id and hashing every block (bench/HISTORY.md).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from proxy.core.prompt.fingerprint import Encoder, Fingerprint, chain

CHUNK_CHARS = 2048  # a raw text prompt is tokenized in chunks of this many characters
CHUNK_IDS = 2048  # a raw token-id prompt is hashed in chunks of about this many ids
S = TypeVar("S", str, bytes)

Blocks = tuple[tuple[int, ...], tuple[int, ...]]  # chained block hashes, each block's end


def fingerprint_tokens(ids: Sequence[int], block_tokens: int, seed: int = 0) -> Fingerprint:
    """Raw prompt as token ids, in blocks of ``block_tokens`` (the last block may be short).

    Anchor 0: with no message boundaries, any content counts as the conversation a request
    continues (damage = the tail it overwrites). The server's own rule instead (continuing
    when it keeps half the content, so other content is discounted as parked in RAM) replayed
    worse (bench/HISTORY.md)."""
    return Fingerprint(*token_blocks(ids, block_tokens, seed))


def token_blocks(ids: Sequence[int], block_tokens: int, previous: int) -> Blocks:
    """``ids`` in blocks of ``block_tokens``, hashes chained from ``previous``."""
    return packed_blocks(packed_ids(ids), block_tokens, previous)


def packed_ids(ids: Sequence[int]) -> bytes:
    """Each id as 4 little-endian bytes, packed in C, not a loop (``TypeError`` for an item
    that is not an integer, ``OverflowError`` for one past 32 bits)."""
    packed = array("i", ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def packed_blocks(raw: bytes, block_tokens: int, previous: int) -> Blocks:
    """``token_blocks`` of ids already packed (``packed_ids``)."""
    hashes: list[int] = []
    view, step, count = memoryview(raw), 4 * block_tokens, len(raw) // 4
    for start in range(0, len(raw), step):
        previous = chain(previous, view[start : start + step])
        hashes.append(previous)
    ends = range(block_tokens, count + block_tokens, block_tokens)
    return tuple(hashes), tuple(min(end, count) for end in ends)


def fingerprint_raw(
    prompt: str | list[Any],
    text_blocks: Callable[[int, str], Blocks],
    id_blocks: Callable[[int, bytes], Blocks],
    block_tokens: int,
    seed: int = 0,
) -> Fingerprint:
    """A raw prompt: token ids (``fingerprint_tokens``' blocks, in chunks of whole blocks,
    each blocked by ``id_blocks(chain hash before it, its packed ids)``), or text
    (``fingerprint_text``). A list that is not all integers (strings, nested prompts) counts
    as its text; ``OverflowError`` for an id past 32 bits."""
    if isinstance(prompt, list):
        try:
            raw = packed_ids(prompt)
        except TypeError:
            prompt = str(prompt)
        else:
            size = 4 * block_tokens * max(1, CHUNK_IDS // block_tokens)  # whole blocks
            return _chunked(raw, size, id_blocks, seed)
    return fingerprint_text(prompt, text_blocks, seed)


def paragraphs(text: str) -> Iterator[str]:
    """``text`` cut before each run of blank lines (``\n\n``, kept with the text after it)."""
    parts = text.split("\n\n")
    pending, run = parts[0], "\n\n"
    for part in parts[1:]:
        if part:
            if pending:
                yield pending
            pending, run = run + part, "\n\n"
        else:
            run += "\n\n"
    if pending:
        yield pending
    if len(run) > 2:
        yield run[2:]  # blank lines the text ends with


def text_blocks(chunk: str, encode: Encoder, block_tokens: int, previous: int) -> Blocks:
    """A raw text chunk's blocks: each paragraph (``paragraphs``) in blocks of
    ``block_tokens``, chained from ``previous``."""
    hashes: list[int] = []
    ends: list[int] = []
    total = 0
    for piece in paragraphs(chunk):
        piece_hashes, piece_ends = token_blocks(encode(piece), block_tokens, previous)
        if piece_hashes:
            hashes += piece_hashes
            ends.extend(map(total.__add__, piece_ends))
            previous, total = piece_hashes[-1], total + piece_ends[-1]
    return tuple(hashes), tuple(ends)


def fingerprint_text(text: str, blocks: Callable[[int, str], Blocks], seed: int = 0) -> Fingerprint:
    """Raw text prompt: ``CHUNK_CHARS`` chunks, each blocked by ``blocks(chain hash before
    it, chunk)`` (``token_blocks`` of its tokens, memoized by the caller), chained in order."""
    return _chunked(text, CHUNK_CHARS, blocks, seed)


def _chunked(prompt: S, size: int, blocks: Callable[[int, S], Blocks], seed: int) -> Fingerprint:
    """``prompt`` in chunks of ``size``, each blocked by ``blocks``, chained in order."""
    hashes: list[int] = []
    tokens: list[int] = []
    previous, total = seed, 0
    for start in range(0, len(prompt), size):
        chunk_hashes, ends = blocks(previous, prompt[start : start + size])
        if chunk_hashes:
            hashes += chunk_hashes
            tokens += (total + end for end in ends)
            previous, total = chunk_hashes[-1], total + ends[-1]
    return Fingerprint(tuple(hashes), tuple(tokens))
