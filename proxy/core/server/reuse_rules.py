"""Which reuse rule a backend applies, told from one probe's ``cache_n``.

llama-server reuses a slot's KV in one of two ways, and neither ``/props``, ``/v1/models``
nor ``/slots`` says which (they report no sliding window and no ``--swa-full``):

- *prefix* (dense models; sliding-window models started with ``--swa-full``): the longest
  common token prefix of the slot's KV and the prompt, wherever the two diverge;
- *exact* (sliding-window models without ``--swa-full``, hybrid and recurrent models): the
  KV can be rolled back only to a *checkpoint* (taken at user-message starts of chat
  prompts, and ``4 + n_ubatch`` and ``4`` tokens before the end of each prompt) or, without
  one, only extended exactly: a prompt that diverges more than about ``n_ubatch`` tokens
  before the end of the slot's sequence reuses a checkpoint at or before the divergence,
  else nothing.

The probe (``plan``): prefill a prompt of ``PROBE_TOKENS`` tokens into one idle slot
(``n_predict: 0``), then send a prompt that shares its first ``PROBE_SHARED`` tokens and
differs after them. The divergence lies ``PROBE_TOKENS - PROBE_SHARED`` tokens before the
end: more than the default ``n_ubatch`` (512) plus a margin, so neither the sliding window
nor the checkpoint ``4 + n_ubatch`` tokens before the end (past the divergence) serves it.
A prefix backend reuses the shared tokens; an exact one reuses none (``classify``). A slot
whose context cannot hold the probe leaves the rule unknown (``plan`` returns None): the
configured default stays. Both prompts' tokens come from the backend's own tokenizer.
"""

from __future__ import annotations

from enum import StrEnum

PROBE_TOKENS = 640  # the first prompt: room for the default n_ubatch (512) past the divergence
PROBE_SHARED = 64  # tokens the second prompt shares with the first
PREFIX_SHARE = 0.9  # of the shared tokens reused: the backend rolls back anywhere
MARGIN = 8  # tokens of a slot's context left free (the sampled token, rounding)


class Rule(StrEnum):
    PREFIX = "prefix"  # reuse up to the divergence, wherever it is
    EXACT = "exact"  # reuse only at checkpoints or as an exact, strict extension


def plan(n_ctx: int) -> tuple[int, int] | None:
    """The probe's prompt length and shared tokens for a slot of ``n_ctx`` tokens (0:
    unknown, the full probe), or None when the slot is too small to tell the rules apart."""
    length = PROBE_TOKENS if n_ctx <= 0 else min(PROBE_TOKENS, n_ctx - MARGIN)
    if length < PROBE_TOKENS:
        return None
    return length, PROBE_SHARED


def classify(shared: int, cache_n: int) -> Rule:
    """The rule a backend applies, from the tokens it reused (``cache_n``) of a prompt that
    shares ``shared`` tokens with the slot's content, diverging far from its end."""
    return Rule.PREFIX if cache_n >= PREFIX_SHARE * shared else Rule.EXACT


def diverging(first: list[int], other: list[int], shared: int) -> list[int] | None:
    """The probe's second prompt: ``first``'s first ``shared`` tokens, then ``other``'s,
    as long as ``first``; None unless it differs from ``first`` right after them."""
    second = (first[:shared] + other)[: len(first)]
    if len(second) < len(first) or second[shared] == first[shared]:
        return None
    return second


def checkpoint_reuse(users: tuple[int, ...], shared: int) -> int:
    """Segments of a slot's chat content an exact backend restores for a prompt sharing
    ``shared`` segments with it: up to the start of the last user message within the shared
    part (a checkpoint is taken at the start of each prompt's last user message, so at
    every user turn of a conversation grown on the slot); 0 without one."""
    return max((i for i in users if i <= shared), default=0)
