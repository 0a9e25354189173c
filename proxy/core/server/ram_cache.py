"""llama-server's host-RAM prompt cache (``--cache-ram``), modelled from outside.

The server keeps saved slot states in a list, oldest first (server-task.cpp,
``server_prompt_cache``); the proxy keeps the same list per backend, of fingerprints
(``RamEntry``: what was saved, when its slot was last used, and its size in the server's own
tokens: the slot's real KV length when known, which the byte budget is counted in; the
fingerprint's estimates can be several times off on code).

*Save* (``save``): the server saves a slot's content when a task takes the slot through the
RAM hook, and every idle slot after each task (``--cache-idle-slots``). A save is skipped
when an entry already contains the content, or when it is larger than the whole cache;
entries the content contains are dropped (a raw prompt's content, saved with its reply, is
contained by no other: ``Fingerprint.sealed``); the oldest go until it fits the byte budget
(``--cache-ram``, 8 GiB by default: configured here in tokens, ``ram_cache_tokens``); the
new entry is the newest.

*Load* (``pick``): the hook runs for a pinned slot that is not empty and would keep less
than half its content (``f_keep < 0.5``, which the server counts as 0 when the slot shares no
more than a tenth of the prompt: ``SIMILARITY``; an empty pinned slot skips it, upstream #28139).
The server scans the entries oldest first and takes one that keeps at least a quarter of
itself (``f_keep >= 0.25``; shares of the real KV length, a raw prompt's reply included:
``BackendState.kv_estimate``; by the prompt alone, a 16-token prompt saved with a 64-token
reply was predicted to load for a prompt continuing it) and beats the best so far in both
kept share and similarity to the prompt, starting from the slot's own content; the last
taken wins (so an older entry can shadow a newer, longer one). The entry taken is *moved*
into the slot: it leaves the cache, and whatever the prompt does not share with it is
overwritten. So a request of another conversation that shares only a header with a parked
session destroys that session's copy unless the pinned slot's own content keeps at least as
large a share — the router scores that as eviction damage (``core.routing.scoring``) and
``Fleet.claim`` removes the entry taken.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

from proxy.core.prompt.fingerprint import Fingerprint, common_segments, shared_tokens

# A load is counted on only when the prompt keeps under this share of the pinned slot's
# content. The server's bar is half, in its own tokens; the shares here are estimates (a raw
# prompt's in tiktoken units, through one tokens-per-estimate scale per backend), and a share
# estimated just under half is often half: Mooncake conversation's two-block prompts, whose
# shared first block is 64 of 144 estimated tokens (0.44; 0.41 by their real KV length) and
# 16 of 32 real ones, so the server did not consult its cache and the prompt was served 16
# tokens where 200-900 were predicted, a few times per run.
SURE_CONSULT = 0.4

# llama-server's ``--slot-prompt-similarity`` default (share of the prompt): a slot whose shared
# prefix with the prompt is no longer than this share of the prompt is not "similar", even when
# pinned, and its ``f_keep`` counts as 0, so the hook runs however much of the slot the prompt
# keeps (``get_available_slot``; ``tests/real/test_fake_parity.py``).
SIMILARITY = 0.1

# *Primer*: a pinned slot the prompt keeps half of or more (another session under the same
# long system prompt) does not run the hook, so a session parked in RAM would not come back
# into it. A short request sharing nothing with the slot (``PRIMER``, prefilled alone) runs
# the hook first: the slot's content is saved, nothing is loaded (no entry keeps a quarter of
# the primer), and the slot holds the primer, of which the request then keeps under half
# (a token at most), so the request's own hook loads its session. ``PRIMER_TOKENS``: what it
# costs, the primer's prefill (about ten tokens in the usual tokenizers, BOS included).
PRIMER = "Primer: the next request loads its session from the prompt cache."
PRIMER_TOKENS = 16


@dataclass(frozen=True)
class RamEntry:
    content: Fingerprint
    at: float  # last use of the slot it came from: its recency weights losing it
    size: int | None = None  # tokens it takes in the cache (None: the fingerprint's estimate)
    # segments a prompt must share for the server to load it (f_keep >= 0.25)
    quarter: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        quarter = bisect_left(self.content.tokens, 0.25 * self.content.total) + 1
        object.__setattr__(self, "quarter", quarter)

    @property
    def tokens(self) -> int:
        return self.content.total if self.size is None else self.size


def shared_segments(fp: Fingerprint, entries: Sequence[RamEntry]) -> tuple[int, ...]:
    """Segments ``fp`` shares with each entry; 0 for one it shares less than a quarter of,
    which the server never loads. One hash compare at the entry's quarter decides that (chain
    hashes cover whole prefixes) and one more at the next segment finds the usual case, a
    prompt sharing just an entry's header (a common system prompt): only entries sharing
    more are binary-searched, so the routing view costs a few compares per entry.
    A prompt that parts inside the segment where the entry's quarter lies (a system prompt
    that differs in a last line) may still share a quarter of it, to the token
    (``shared_tokens``): the server compares tokens, and loads such an entry."""
    hashes, n, out = fp.hashes, len(fp.hashes), []
    for entry in entries:
        q, own = entry.quarter, entry.content.hashes
        if q > n or hashes[q - 1] != own[q - 1]:
            out.append(_into_quarter(fp, entry))
        elif q == n or q == len(own) or hashes[q] != own[q]:
            out.append(q)
        else:
            out.append(common_segments(hashes, own, q + 1))
    return tuple(out)


def _into_quarter(fp: Fingerprint, entry: RamEntry) -> int:
    """For an entry ``fp`` does not share whole segments up to its quarter with: the
    segments before that quarter's segment when they are shared and the prompt's share of
    that segment (its pieces) reaches the quarter; else 0. Pieces count only before the
    prompt's conversation (``shared_tokens``), and only in the segment the quarter lies in:
    a prompt parting earlier keeps less than the segments before it."""
    at, own = entry.quarter - 1, entry.content.hashes
    if not fp.parts or at < 1 or at >= len(fp.hashes) or fp.hashes[at - 1] != own[at - 1]:
        return 0
    return at if shared_tokens(fp, entry.content, at) >= 0.25 * entry.content.total else 0


def consulted(kept: int, content_tokens: int, prompt_tokens: int, share: float = 0.5) -> bool:
    """Whether pinning to a slot holding ``content_tokens`` of which the prompt keeps
    ``kept`` makes the server consult its RAM cache: ``f_keep < 0.5`` (NaN when empty), where
    the server counts ``f_keep`` as 0 when the kept prefix is no more than ``SIMILARITY`` of
    the prompt (a pinned slot is then not "similar": its ``f_sim_best`` stays 0). ``share``: a
    lower bar (``SURE_CONSULT``, both shares scaled alike), for a consult counted on beyond
    doubt."""
    if content_tokens <= 0:
        return False
    return kept < share * content_tokens or kept <= share * 2 * SIMILARITY * prompt_tokens


def pick(
    entries: Sequence[tuple[int, int]],
    kept: int,
    content_tokens: int,
    prompt_tokens: int,
    ties: bool = False,
) -> int | None:
    """Index of the entry the server loads, or None. ``entries``: per entry, oldest first,
    (tokens it serves the prompt, its length); ``kept``/``content_tokens``: the same for the
    slot's own content (0/0: empty, any entry wins). ``ties``: an entry that serves the
    prompt as far as the slot's content does, by the fingerprint's segments, may beat it by
    a few tokens the segments do not resolve (the server compares exact tokens): counted as
    loaded, so that what loading it destroys is counted (magagent: a session's parked turn
    taken by another session's request sharing the system prompt, 361 tokens against 358)."""
    if prompt_tokens <= 0:
        return None
    keep_best = kept / content_tokens if content_tokens else -1.0
    sim_best = kept / prompt_tokens
    chosen = None
    for index, (reuse, length) in enumerate(entries):
        if reuse <= 0:
            continue  # keeps nothing: never loaded (most entries, for most prompts)
        keep, sim = (reuse / length if length else 0.0), reuse / prompt_tokens
        tied = ties and chosen is None and reuse == kept
        if keep >= 0.25 and keep > keep_best and (sim > sim_best or tied):
            chosen, keep_best, sim_best = index, keep, sim
    return chosen


def contains(entry: Fingerprint, content: Fingerprint) -> bool:
    """``content``, with the unseen tail it may be sealed with, is a prefix of ``entry``."""
    if content.sealed and len(content.hashes) != len(entry.hashes):
        return False  # its tail (a raw prompt's reply) continues no other chain
    return covers(entry, content)


def covers(entry: Fingerprint, content: Fingerprint) -> bool:
    """``content``'s chain is a prefix of ``entry``'s: each chain hash covers the whole
    prefix up to its segment, so comparing ``entry``'s hash at ``content``'s last segment
    decides it."""
    n = len(content.hashes)
    return n == 0 or (n <= len(entry.hashes) and entry.hashes[n - 1] == content.hashes[-1])


def _make_room(
    entries: Sequence[RamEntry], new: RamEntry, budget: int | None
) -> tuple[list[RamEntry], int] | None:
    """None when the server skips saving ``new`` (already held, or larger than the whole
    cache); else the entries the save keeps (those ``new`` contains are dropped) and how
    many of their oldest go to make room under ``budget``."""
    content, size = new.content, new.tokens
    if not content.hashes or any(contains(e.content, content) for e in entries):
        return None
    if budget is not None and size > budget:
        return None
    kept = [e for e in entries if not contains(content, e.content)]
    held, gone = sum(e.tokens for e in kept), 0
    while budget is not None and gone < len(kept) and held + size > budget:
        held, gone = held - kept[gone].tokens, gone + 1
    return kept, gone


def save(
    entries: Sequence[RamEntry], new: RamEntry, limit: int, budget: int | None = None
) -> list[RamEntry]:
    """The cache after saving ``new``; ``budget``: tokens the cache holds (``--cache-ram``
    MiB over the model's KV bytes per token), None for no bound but ``limit`` entries."""
    room = _make_room(entries, new, budget)
    if room is None:
        return list(entries)
    kept, gone = room
    after = [*kept[gone:], new]
    return after[-limit:] if limit > 0 else []


def evicted_by(entries: Sequence[RamEntry], new: RamEntry, budget: int | None) -> int:
    """How many of the oldest entries saving ``new`` evicts (the server saves a pinned
    slot's content *before* it loads an entry, so those cannot be loaded)."""
    if budget is None:
        return 0
    room = _make_room(entries, new, budget)
    if room is None or not room[1]:
        return 0
    kept, gone = room
    return entries.index(kept[gone - 1]) + 1


def without(entries: Sequence[RamEntry], gone: RamEntry | None) -> list[RamEntry]:
    """The cache after ``gone`` was loaded into a slot (it leaves the cache); the same list
    when nothing left it (as ``park``)."""
    if isinstance(entries, list) and (gone is None or all(e is not gone for e in entries)):
        return entries
    return [e for e in entries if e is not gone]


def hook_runs(content: Fingerprint, prompt: Fingerprint, length: int | None = None) -> bool:
    """Whether ``prompt``, pinned to a slot holding ``content`` (``length``: its KV length in
    estimate units, a raw prompt's reply included), makes the server save the slot and load
    from its RAM cache: it keeps less than half of the content (``consulted``)."""
    kept = shared_tokens(prompt, content)  # (to the token: into a message both start alike)
    return consulted(kept, content.total if length is None else length, prompt.total)


def needs_park(
    content: Fingerprint,
    prompt: Fingerprint,
    length: int,
    ram: bool,
    always: bool = False,
    in_ram: bool = False,
) -> bool:
    """Whether ``prompt``, pinned to a slot holding ``content`` (``length`` as in
    ``hook_runs``), loses a session that only a disk snapshot brings back: the prompt does not
    continue its conversation nor keep all of it, and the server does not park it in RAM
    itself (no RAM cache, or the prompt keeps at least half of it, so the hook does not run:
    agent sessions sharing a long system prompt), nor holds it there already where a primer
    can bring it back (``in_ram``: a primer runs the hook first, or an idle save made a copy).
    ``always``: also where the server does."""
    shared = common_segments(prompt.hashes, content.hashes)
    kept = shared_tokens(prompt, content, shared)
    if content.same_conversation(shared) or kept >= content.total:
        return False
    return always or not ram or not (in_ram or consulted(kept, length, prompt.total))


def held(entries: Sequence[RamEntry], content: Fingerprint) -> bool:
    """Whether one of ``entries`` contains ``content`` (a copy the server may load back)."""
    return any(contains(entry.content, content) for entry in entries)


def park(
    entries: Sequence[RamEntry],
    before: RamEntry | None,
    after: Fingerprint | None,
    limit: int,
    budget: int | None = None,
) -> list[RamEntry]:
    """The cache after a task takes a slot: its content ``before`` is saved (None: not, or
    an idle slot's save with ``after`` None); entries the slot's new content ``after``
    contains are dropped (saving the slot later drops them)."""
    kept = drop_contained(entries, after)
    if before is not None and (after is None or not contains(after, before.content)):
        kept = save(kept, before, limit, budget)
    same = len(kept) == len(entries) and all(a is b for a, b in zip(kept, entries, strict=True))
    # the same list when nothing changed (most saves are of content already held): a
    # waiting request's view of it stays valid (``scoring.ram_view``)
    return entries if same and isinstance(entries, list) else kept


def drop_contained(entries: Sequence[RamEntry], content: Fingerprint | None) -> list[RamEntry]:
    """The cache without entries ``content`` contains: a slot now holds them, and saving the
    slot later drops them."""
    if content is None:
        return list(entries)
    return [e for e in entries if not contains(content, e.content)]
