"""Which prefix of a prompt the disk tier snapshots: the scope policy.

A scope is one of (``--disk-prefix-cache``, or per request ``prefix_cache.scope``):

- ``off``: no save, no restore;
- ``full``: after the request, the whole slot (prompt and reply, as the KV holds them);
- ``N``: the first N prompt tokens, aligned down to a safe chat boundary;
- ``auto:N`` (``auto`` = ``auto:30``): the *stable prefix* of this request, selected from the
  window of the N most recent requests of the same model, then aligned down the same way.

Stable prefix, precisely. Boundaries are fingerprint segments (``core.prompt.fingerprint``: the
preamble of tools and template kwargs, then one segment per message), so every candidate
prefix ends at a message boundary. For each request r in the window, ``s_r`` is the number of
segments r shares with this request (``common_segments`` on the hash chains). The
*candidates* are the requests sharing at least the first segment (``s_r >= 1``): the ones
built from the same system prompt and tools; requests of other agents do not vote. The
selected prefix is the longest ``k`` that at least half of the candidates share:
``k`` = the ``ceil(|C|/2)``-th largest ``s_r``. With no candidate nothing is selected yet.

So a larger window gives a shorter but more stable key: with ``auto:2`` the candidates are
usually the same session's previous turns and ``k`` is most of its history (a key that moves
every turn), while with ``auto:30`` over interleaved sessions the majority shares only the
system prompt and tools (a key every session hits). The window does not need every request
to share the prefix: half of the related ones suffice.

Who decides. The operator's scope (``--disk-prefix-cache``) is the widest a request may
use; a client's ``prefix_cache`` may only narrow it (``narrowed``), never widen it: a
client scope that is not narrower is replaced by the operator's. *Narrower or equal*
(``narrower``), by what the scope can write to disk:

- ``off`` is narrower than everything, and under ``off`` only ``off`` is allowed (final);
- everything is narrower than ``full`` (scoped saves hold part of the prompt; ``full``
  the whole slot, prompt and reply);
- ``N`` is narrower than ``M`` when ``N <= M`` (at most N prompt tokens per snapshot);
- ``auto:N`` is narrower than ``auto:M`` when ``N >= M``: a larger window selects the
  prefix a larger share of requests agree on, a shorter and more stable key (see above),
  while a small window selects most of one session's history, a new file every turn;
- ``N`` and ``auto:M`` are not comparable (a client cannot trade one for the other).

A selection under ``min_tokens`` (``--kv-cache-min-tokens``) is dropped: small prefixes cost
more in files than they save. The caller then checks the boundary is *safe* (the rendering
of the first k messages is a true prefix of the full rendering; some templates rewrite
earlier turns) and steps down a boundary when it is not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from proxy.core.prompt.fingerprint import Fingerprint, common_segments

DEFAULT_WINDOW = 30
MAX_WINDOW = 1000


class ScopeMode(StrEnum):
    OFF = "off"
    FULL = "full"
    AUTO = "auto"
    FIXED = "fixed"


@dataclass(frozen=True)
class Scope:
    mode: ScopeMode
    window: int = DEFAULT_WINDOW  # auto: requests looked back at
    tokens: int = 0  # fixed: prompt tokens to keep

    def __str__(self) -> str:
        if self.mode is ScopeMode.AUTO:
            return f"auto:{self.window}"
        if self.mode is ScopeMode.FIXED:
            return str(self.tokens)
        return self.mode.value


def parse_scope(text: str) -> Scope:
    """``off|full|auto|auto:N|N`` -> Scope; ``ValueError`` with a readable message."""
    value = text.strip().lower()
    if value in ("off", "full"):
        return Scope(ScopeMode(value))
    if value == "auto":
        return Scope(ScopeMode.AUTO)
    head, sep, tail = value.partition(":")
    if head == "auto" and sep:
        return Scope(ScopeMode.AUTO, window=_positive(tail, "auto:N window", MAX_WINDOW))
    if value.isdigit():
        return Scope(ScopeMode.FIXED, tokens=_positive(value, "token count", 10**9))
    raise ValueError(f"scope must be off, full, auto, auto:N or N, not {text!r}")


def _positive(text: str, what: str, most: int) -> int:
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise ValueError(f"{what} must be an integer in 1..{most}, not {text!r}")
    return int(text)


def with_window(scope: Scope, window: int | None) -> Scope:
    """``prefix_cache.window`` overrides the auto window (other modes ignore it)."""
    if window is None or scope.mode is not ScopeMode.AUTO:
        return scope
    if not 1 <= window <= MAX_WINDOW:
        raise ValueError(f"window must be in 1..{MAX_WINDOW}")
    return Scope(ScopeMode.AUTO, window=window)


def narrower(client: Scope, operator: Scope) -> bool:
    """Whether ``client`` is narrower than or equal to ``operator`` (module docstring)."""
    if client.mode is ScopeMode.OFF or operator.mode is ScopeMode.FULL:
        return True
    if client.mode is not operator.mode:
        return False
    if client.mode is ScopeMode.FIXED:
        return client.tokens <= operator.tokens
    return client.window >= operator.window  # both auto


def narrowed(operator: Scope, client: Scope | None) -> Scope:
    """The scope a request uses: the client's when it only narrows the operator's."""
    return client if client is not None and narrower(client, operator) else operator


@dataclass(frozen=True)
class ScopeChoice:
    segments: int  # prefix length in fingerprint segments; 0 = nothing to snapshot
    tokens: int  # its estimated tokens
    candidates: int  # auto: window requests sharing at least the first segment


NOTHING = ScopeChoice(0, 0, 0)


def select_prefix(
    scope: Scope, fp: Fingerprint, window: Sequence[Fingerprint], min_tokens: int
) -> ScopeChoice:
    """The prefix of ``fp`` to snapshot before the request (``off``/``full``: none)."""
    if scope.mode is ScopeMode.FIXED:
        segments = sum(1 for t in fp.tokens if t <= scope.tokens)
        candidates = 0
    elif scope.mode is ScopeMode.AUTO:
        counts = (common_segments(fp.hashes, r.hashes) for r in window[: scope.window])
        shared = sorted((s for s in counts if s), reverse=True)
        if not shared:
            return NOTHING
        segments = shared[math.ceil(len(shared) / 2) - 1]
        candidates = len(shared)
    else:
        return NOTHING
    tokens = fp.tokens_at(segments)
    if segments == 0 or tokens < max(1, min_tokens):
        return ScopeChoice(0, 0, candidates)
    return ScopeChoice(segments, tokens, candidates)
