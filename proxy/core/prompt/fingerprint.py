"""Fingerprint a prompt as a chain of segment hashes with cumulative token counts.

Segments follow the boundaries at which one request's prompt stops matching the next one's:

- chat bodies (``messages``): segment 0 is the *preamble*, everything the template renders
  before the first message — ``tools`` and ``chat_template_kwargs`` (tools are rendered into
  the system block, so a change of tools changes the whole prefix); then one segment per
  message: the canonical JSON (sorted keys, compact) of its ``role``, ``content``,
  ``tool_calls``, ``tool_call_id``, ``name`` and ``reasoning_content``;
- Responses bodies (``input``): preamble from ``instructions`` and ``tools``, then one
  segment per input item (a string input is one user message);
- raw prompts (``/completion``, ``/v1/completions``, ``/infill``): fixed blocks of
  ``block_tokens`` tokens (``core.prompt.raw_blocks``).

A raw prompt's slot keeps the reply after it, which the next prompt does not repeat: the
slot's content is then ``sealed`` (``Router.content_after``), so the RAM model does not take
it to be part of a longer prompt's (``core.server.ram_cache.contains``).

The *anchor* is the number of segments through the first non-system message: a request
that shares at least that much with a slot continues the slot's conversation (routing uses
it to tell a returning session from a stranger that only shares the system prompt).

The chain: ``h[0] = H(seed || seg[0])``, ``h[i] = H(h[i-1] || seg[i])``, so ``h[i]`` identifies the
whole prefix up to segment ``i`` and two chains share a prefix of ``k`` segments exactly when
``h[k-1]`` is equal; ``common_segments`` finds ``k`` by binary search. The ``seed`` is 0,
or a tenant's salt under cache isolation (``core.prompt.isolation``): two tenants' chains then
never share a hash, so nothing keyed by chains (slot contents, snapshots) is found across
tenants. The generation suffix (``<|im_start|>assistant``) is never part of the key, so
turn N and turn N+1 share every
segment up to turn N's last message, and a reply appended as an assistant message extends
the chain exactly as the client will send it back.

Token counts are estimates from the injected ``count`` function (tiktoken by default, or the
backend's tokenizer), plus ``MESSAGE_OVERHEAD`` template tokens per message; they rank slots,
while real reuse is read back from llama-server's ``cache_n``.

*Parts*: the server reuses a slot up to the first token that differs, which may lie inside a
message: two agent sessions whose system prompts differ only in a last line (a session id, a
date) share most of that message. So a segment before the anchor's (the preamble, system
messages) of ``PART_BYTES`` or more also carries the chain of hashes of its key's
``PART_BYTES`` pieces (``Fingerprint.parts``), seeded with the chain hash before it (a tenant's
salt reaches them too). Where two chains part in such a segment, ``shared_tokens`` adds the
share of it their pieces have in common, its tokens counted in proportion to its bytes; only
past a shared segment holding tokens (two prompts whose first such segment differs are
strangers to routing), and only in the estimates of what a slot serves and keeps, not in the
chains (a segment still counts as shared only whole).
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

MESSAGE_OVERHEAD = 4  # role markers and separators of a typical chat template
# bytes of a segment's key per piece hashed for partial sharing (``parts``): a few pieces for
# a long system prompt, whose parting (a last line) is then placed to within 512 bytes
PART_BYTES = 512
_MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content")
_PREAMBLE_KEYS = ("tools", "chat_template_kwargs", "instructions")

Counter = Callable[[str], int]
Encoder = Callable[[str], Sequence[int]]


@dataclass(frozen=True)
class Segment:
    key: bytes  # canonical bytes hashed into the chain
    text: str  # what the template renders, for counting tokens


@dataclass(frozen=True)
class Fingerprint:
    hashes: tuple[int, ...]
    tokens: tuple[int, ...]  # cumulative estimated tokens after each segment
    anchor: int = 0  # segments up to and including the first non-system message
    # the KV holds more after the chain that no later prompt is known to repeat (a raw
    # prompt's reply): no other chain contains this content but its own
    sealed: bool = False
    # segments at which a user message starts (chat): where a checkpointing backend
    # (``core.server.reuse_rules``) can roll a slot back to
    users: tuple[int, ...] = ()
    # the long segments' pieces (module docstring): (segment, its key's bytes, the pieces'
    # chain hashes packed 8 bytes each); a truncated chain keeps none
    parts: tuple[Part, ...] = field(default=(), compare=False, repr=False)
    # the first segment holding a token (-1: none; a chat preamble may be empty), and the
    # *head*: it and its chain hash. Two chains share a token exactly when their heads are
    # equal (equal segments carry equal token estimates); None when no segment holds one.
    # (Worked out once: routing reads them for every slot it groups.)
    first: int = field(init=False, compare=False, repr=False)
    head: tuple[int, int] | None = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        first = next((i for i, tokens in enumerate(self.tokens) if tokens > 0), -1)
        object.__setattr__(self, "first", first)
        object.__setattr__(self, "head", (first, self.hashes[first]) if first >= 0 else None)

    @property
    def total(self) -> int:
        return self.tokens[-1] if self.tokens else 0

    def tokens_at(self, segments: int) -> int:
        return self.tokens[segments - 1] if segments > 0 else 0

    def extend(self, segments: Sequence[Segment], count: Counter) -> Fingerprint:
        """This chain followed by ``segments`` (e.g. the reply the client will send back)."""
        hashes, tokens = list(self.hashes), list(self.tokens)
        _append(hashes, tokens, segments, count)
        return Fingerprint(
            tuple(hashes), tuple(tokens), self.anchor, users=self.users, parts=self.parts
        )

    def prefix(self, segments: int) -> Fingerprint:
        """The chain of the first ``segments`` segments (a slot's KV cut short), with what
        it knows of them: where their user messages start, their pieces."""
        return Fingerprint(
            self.hashes[:segments],
            self.tokens[:segments],
            self.anchor,
            users=tuple(u for u in self.users if u < segments),
            parts=tuple(p for p in self.parts if p[0] < segments),
        )

    def part(self, segment: int) -> Part | None:
        """Segment ``segment``'s pieces, if it has them."""
        return next((p for p in self.parts if p[0] == segment), None)

    def same_conversation(self, shared: int) -> bool:
        """True when a request sharing ``shared`` segments with this content continues its
        conversation: the shared part reaches past the system prompt into its first user
        message (where agents such as OpenClaw put the session id)."""
        return shared >= self.anchor


Part = tuple[int, int, bytes]  # (segment, its key's length in bytes, packed piece hashes)


def chain(previous: int, key: bytes | memoryview) -> int:
    return int(xxhash.xxh3_64_intdigest(key, seed=previous))


def _pieces(previous: int, key: bytes) -> bytes:
    """The chain of ``key``'s whole ``PART_BYTES`` pieces, 8 bytes each, little-endian (as
    slot records store them for other replicas)."""
    digest, view, out = xxhash.xxh3_64_intdigest, memoryview(key), []
    for start in range(0, len(key) - PART_BYTES + 1, PART_BYTES):
        previous = digest(view[start : start + PART_BYTES], previous)
        out.append(previous)
    packed = array("Q", out)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _append(
    hashes: list[int],
    tokens: list[int],
    segments: Sequence[Segment],
    count: Counter,
    seed: int = 0,
    parts: list[Part] | None = None,
    parted: int = 0,
) -> None:
    """Chain ``segments`` on; the long ones of the first ``parted`` with their pieces."""
    for segment in segments:
        previous = hashes[-1] if hashes else seed
        if parts is not None and len(hashes) < parted and len(segment.key) >= PART_BYTES:
            parts.append((len(hashes), len(segment.key), _pieces(previous, segment.key)))
        hashes.append(chain(previous, segment.key))
        tokens.append((tokens[-1] if tokens else 0) + count(segment.text))


def shared_tokens(a: Fingerprint, b: Fingerprint, shared: int | None = None) -> int:
    """Tokens of ``a`` that ``b`` holds too (``shared``: their common segments, if known):
    the shared segments' and, past a shared segment holding tokens, the common share of the
    segment where they part, if that lies before ``a``'s anchor segment (module docstring):
    what another conversation serves a request stays within the prompt before its
    conversation (routing bounds another conversation's slot by that)."""
    shared = common_segments(a.hashes, b.hashes) if shared is None else shared
    kept = a.tokens_at(shared)
    if shared <= a.first or shared >= a.anchor - 1 or shared >= len(b.hashes):
        return kept
    mine, theirs = a.part(shared), b.part(shared)
    if mine is None or theirs is None:
        return kept
    pieces, same = mine[2], theirs[2]
    common = 0
    for at in range(0, min(len(pieces), len(same)), 8):
        if pieces[at : at + 8] != same[at : at + 8]:
            break
        common += 1
    if not common:
        return kept
    segment_tokens = a.tokens[shared] - kept
    return kept + segment_tokens * common * PART_BYTES // mine[1]


def common_segments(a: Sequence[int], b: Sequence[int], lo: int = 0) -> int:
    """Length of the shared prefix of two hash chains (binary search on chain equality);
    ``lo``: segments already known to be shared."""
    hi = min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "".join(p for p in parts if isinstance(p, str))
    return "" if content is None else json.dumps(content)


def message_segment(message: dict[str, Any]) -> Segment:
    kept = {k: message[k] for k in _MESSAGE_KEYS if message.get(k)}  # "" and null render alike
    content = kept.get("content")
    if len(kept) <= 2 and isinstance(content, str) and isinstance(kept.get("role"), str):
        # fast path for plain text messages: no JSON encoding (a leading 0x01 byte keeps
        # these keys apart from canonical JSON, which starts with '{')
        key = b"\x01" + kept["role"].encode() + b"\x00" + content.encode()
        return Segment(key, kept["role"] + content)
    text = _content_text(message.get("content"))
    if message.get("tool_calls"):
        text += json.dumps(message["tool_calls"], separators=(",", ":"))
    if isinstance(message.get("reasoning_content"), str):
        text += message["reasoning_content"]
    return Segment(canonical(kept), str(message.get("role", "")) + text)


def preamble_segment(body: dict[str, Any]) -> Segment:
    kept = {k: body[k] for k in _PREAMBLE_KEYS if body.get(k) is not None}
    text = json.dumps(kept["tools"], separators=(",", ":")) if "tools" in kept else ""
    if isinstance(kept.get("instructions"), str):
        text += kept["instructions"]
    return Segment(canonical(kept), text)


def chat_segments(body: dict[str, Any]) -> list[Segment]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        items = body.get("input")
        messages = [{"role": "user", "content": items}] if isinstance(items, str) else items
    segments = [preamble_segment(body)]
    for message in messages if isinstance(messages, list) else []:
        if isinstance(message, dict):
            segments.append(message_segment(message))
    return segments


def _overhead(count: Counter) -> Counter:
    def counted(text: str) -> int:
        return count(text) + MESSAGE_OVERHEAD if text else 0

    return counted


def fingerprint_chat(body: dict[str, Any], count: Counter, seed: int = 0) -> Fingerprint:
    return fingerprint_segments(chat_segments(body), count, seed)


def fingerprint_segments(segments: Sequence[Segment], count: Counter, seed: int = 0) -> Fingerprint:
    """The chain of already split chat segments (``chat_segments``)."""
    hashes: list[int] = []
    tokens: list[int] = []
    parts: list[Part] = []
    anchor = next(
        (i + 1 for i, seg in enumerate(segments[1:], 1) if not seg.text.startswith("system")),
        len(segments),
    )
    # pieces before the first message not a system one: where sessions' prompts part (and
    # what ``shared_tokens`` reads), at a cost per request in proportion to those bytes
    _append(hashes, tokens, segments, _overhead(count), seed, parts, anchor - 1)
    users = tuple(i for i, seg in enumerate(segments) if i and seg.text.startswith("user"))
    return Fingerprint(tuple(hashes), tuple(tokens), anchor, users=users, parts=tuple(parts))


def reply_segment(content: str, tool_calls: list[Any] | None) -> Segment:
    """The assistant message a client sends back after receiving this reply."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message_segment(message)


def continues(fp: Fingerprint, content: Fingerprint) -> bool:
    """``fp`` continues ``content``'s conversation (shares its first user message) or keeps
    at least half of it: overwriting ``content`` with ``fp`` loses nothing of value."""
    shared = common_segments(fp.hashes, content.hashes)
    return content.same_conversation(shared) or content.tokens_at(shared) >= content.total / 2
