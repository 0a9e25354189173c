"""Prefix churn: where a session's prompt stopped matching its previous prompt.

An agent's turn N+1 should extend turn N (system prompt, tools, history, then new messages).
When it does not, everything after the first difference is re-prefilled, and users see a low
hit rate without knowing why (a timestamp in the system prompt, a tool list that changes
order, a rewritten earlier message, a transient last message). For each session the proxy
keeps a *sketch* of its last prompt: per segment (``core.prompt.fingerprint``: the preamble of tools
and template kwargs, then one segment per message) the chain hash, cumulative tokens, role,
and the first ``EXCERPT`` characters of its text. ``divergence`` compares a new prompt with
the sketch: the shared segments are found on the hash chains; if the new prompt does not
contain the whole previous prompt, it reports the first differing segment: its message index
(-1 for the preamble), role, token offset, the tokens of the previous prompt lost, and the
two texts around their first differing character.

Sessions are keyed by the request's cache_key when it has one, otherwise by the text of its
first user message alone (agents such as OpenClaw put the session id there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.core.prompt.fingerprint import Fingerprint, Segment, common_segments

EXCERPT = 240  # characters of each segment kept in a sketch
CONTEXT = 40  # characters shown around a difference


@dataclass(frozen=True)
class Sketch:
    fp: Fingerprint
    roles: tuple[str, ...]
    texts: tuple[str, ...]  # the first EXCERPT characters of each segment's text


@dataclass(frozen=True)
class Divergence:
    session: str
    message_index: int  # -1: the preamble (tools, template kwargs)
    role: str
    token_offset: int  # estimated tokens shared before the difference
    tokens_lost: int  # estimated tokens of the previous prompt that cannot be reused
    before: str  # the previous prompt around the first difference
    after: str  # the new prompt around it
    at: float


def sketch(fp: Fingerprint, segments: Sequence[Segment]) -> Sketch:
    roles = ("preamble", *(_role(s) for s in segments[1:]))
    return Sketch(fp, roles, tuple(s.text[:EXCERPT] for s in segments))


def _role(segment: Segment) -> str:
    for role in ("system", "developer", "user", "assistant", "tool"):
        if segment.text.startswith(role):
            return role
    return "other"


def divergence(session: str, old: Sketch, new: Sketch, now: float) -> Divergence | None:
    """Where ``new`` stops containing ``old`` (None when it extends all of it)."""
    shared = common_segments(old.fp.hashes, new.fp.hashes)
    if shared >= len(old.fp.hashes):
        return None
    before, after = _around(old.texts[shared], new.texts[shared] if shared < len(new.texts) else "")
    return Divergence(
        session=session,
        message_index=shared - 1,
        role=new.roles[shared] if shared < len(new.roles) else old.roles[shared],
        token_offset=old.fp.tokens_at(shared),
        tokens_lost=old.fp.total - old.fp.tokens_at(shared),
        before=before,
        after=after,
        at=now,
    )


def _around(a: str, b: str) -> tuple[str, str]:
    """The two texts around their first differing character."""
    first = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    start = max(0, first - CONTEXT)
    return a[start : first + CONTEXT], b[start : first + CONTEXT]


def message_bucket(index: int) -> str:
    """A bounded metric label for a message index."""
    if index < 0:
        return "preamble"
    return str(index) if index < 10 else "10+"
