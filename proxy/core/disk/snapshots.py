"""The disk tier's index of KV snapshots, and the rules for using it.

A snapshot is a llama-server slot save file holding the KV of one prompt prefix. The index
(in the state store, shared by replicas) maps ``key(model, chain)`` to the snapshots of that
prefix, at most one per save directory:

- ``model`` is the model identity (``Layout.model_id``: model path and weight type, from
  ``/props``); ``chain`` is the fingerprint chain hash at the prefix's last segment, which
  identifies the prefix exactly (canonical messages, tools and template kwargs, or the token
  ids of a raw prompt). So different prompts never collide, and one prompt saved for two
  models is two snapshots. File names are a hash of (model, layout, chain) and nothing else.
- ``Layout`` records what a save file depends on (reference §5): model path and type,
  context per slot, slot count (``-np``) and unified KV. A file loads only into a server with
  the same layout; llama-server checks only part of it (a different model of the same shape
  loads silently), so ``refusal`` checks all of it before any restore.
- A whole-slot snapshot (``full``, park) holds the prompt and the reply; it is also indexed
  under shorter prefixes (``aliases``: the prompt without the reply, the prompt without its
  last message too, and the session's first user message), since the next turn may not
  send the reply back verbatim (agents that rewrite or drop it), may drop a transient last
  message (OpenClaw's default profile ends each request with one), and a restore serves
  every request sharing part of the file (the server then reuses the longest common
  prefix).
- ``directory`` names where the file lives: a save directory shared by several backends
  (``dir:PATH``) or one backend's own (``backend:LABEL``); a snapshot can be restored on any
  backend of the same directory.

Lookup: for each backend, the longest indexed prefix of the request in its directory with a
compatible layout and not marked bad (``offers``). Its value for routing is its estimated
tokens minus the restore cost in prefill-token equivalents,
``restore_s * prefill_tps = nbytes / restore_bytes_per_s * prefill_tokens_per_s``, both
speeds measured from the backends' own timings.

Bad snapshots: a restore that succeeds but is followed by a re-prefill (``cache_n`` under
half of what was restored) means the file does not match what the prompt renders to now;
it is marked bad and never offered again. Budget: per directory, least recently used
snapshots are evicted until the total size fits (``evictions``).

The index is untrusted input (anyone who can write to the store can write it):
``unpack_entries`` keeps only well-formed entries whose name is one the proxy generates
(``valid_name``: ``llp-`` and 32 lower-case hex digits, ``.bin``), so a stored name is never
a path (``/etc/passwd``, ``../x``) when it is opened, deleted or sent to llama-server; and
the one it generates for the entry's layout and chain (``file_name``), so an entry cannot
name another model's file as its own: a server restores a file saved by another model of the
same shape without a word. A lookup keeps only the entries of the model and prefix it asks
for (``belongs``).

Strays: ``llp-*.bin`` files in a directory the index does not list (the index was lost with
the store, or a save's entry was never written) still take space. ``stray_evictions``
counts them toward the budget and deletes them first, oldest first, since nothing can
restore them; files with any other name are never counted or touched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import xxhash

from proxy.core.prompt.fingerprint import Fingerprint


@dataclass(frozen=True)
class Layout:
    model: str  # model path as the server reports it
    ftype: str  # weight type (model_ftype)
    n_ctx: int  # context per slot
    slots: int  # total_slots (-np)
    unified: bool | None = None  # unified KV; None when not configured

    @classmethod
    def from_props(cls, props: Mapping[str, Any], unified: bool | None) -> Layout:
        """The layout a backend's ``/props`` reports (plus unified KV from the config)."""
        settings = props.get("default_generation_settings") or {}
        return cls(
            model=str(props.get("model_path", "")),
            ftype=str(props.get("model_ftype", "")),
            n_ctx=int(settings.get("n_ctx", 0) or 0),
            slots=int(props.get("total_slots", 0) or 0),
            unified=unified,
        )

    @property
    def model_id(self) -> str:
        return xxhash.xxh3_64_hexdigest(f"{self.model}\x00{self.ftype}".encode())

    def refusal(self, other: Layout) -> str | None:
        """Why a file saved under ``self`` must not be restored into ``other`` (or None)."""
        if (self.model, self.ftype) != (other.model, other.ftype):
            return "model"
        if self.n_ctx != other.n_ctx:
            return "n_ctx"
        if self.slots != other.slots:
            return "slots"
        if None not in (self.unified, other.unified) and self.unified != other.unified:
            return "unified"
        return None


@dataclass(frozen=True)
class Snapshot:
    name: str  # file name in the directory
    directory: str
    chain: int  # fingerprint chain hash at the prefix's end
    segments: int
    tokens: int  # KV tokens in the file (n_saved)
    estimate: int  # the prefix's estimated tokens, in fingerprint units
    nbytes: int
    layout: Layout
    created: float
    last_used: float
    hits: int = 0
    bad: bool = False
    aliases: tuple[int, ...] = ()  # shorter prefixes' chain hashes it is indexed under too

    @property
    def keys(self) -> tuple[int, ...]:
        """Every chain hash the snapshot is indexed under."""
        return (self.chain, *self.aliases)

    def pack(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def unpack(cls, data: Mapping[str, Any]) -> Snapshot:
        fields = dict(data)
        fields["layout"] = Layout(**fields["layout"])
        fields["aliases"] = tuple(fields.get("aliases", ()))
        return cls(**fields)


def index_key(model_id: str, chain: int) -> str:
    return f"{model_id}:{chain:016x}"


_NAME = re.compile(r"llp-[0-9a-f]{32}\.bin")


def valid_name(name: object) -> bool:
    """Whether ``name`` is a file name ``file_name`` makes (and so no path)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def file_name(layout: Layout, chain: int) -> str:
    """A file name made of hashes only (llama-server's filename rules, reference §5)."""
    digest = xxhash.xxh3_128_hexdigest(f"{layout!r}\x00{chain}".encode())
    return f"llp-{digest}.bin"


def pack_entries(entries: Iterable[Snapshot]) -> bytes:
    return json.dumps([e.pack() for e in entries], separators=(",", ":")).encode()


def unpack_entries(raw: bytes | str | None) -> list[Snapshot]:
    """The well-formed entries of a stored value; anything else in it is dropped."""
    try:
        items = json.loads(raw) if raw else []
    except (ValueError, RecursionError):
        return []
    out = []
    for item in items if isinstance(items, list) else []:
        try:
            snapshot = Snapshot.unpack(item)
        except (TypeError, ValueError, KeyError):
            continue
        if _sound(snapshot):
            out.append(snapshot)
    return out


def _sound(s: Snapshot) -> bool:
    """Field types a stored entry must have to be used (and its name one the proxy makes)."""
    counts = (s.chain, s.segments, s.tokens, s.estimate, s.nbytes, s.hits, *s.aliases)
    layout = s.layout
    return (
        valid_name(s.name)
        and isinstance(s.directory, str)
        and all(type(n) is int and n >= 0 for n in (*counts, layout.n_ctx, layout.slots))
        and all(type(t) in (int, float) for t in (s.created, s.last_used))
        and isinstance(s.bad, bool)
        and isinstance(layout.model, str)
        and isinstance(layout.ftype, str)
        and (layout.unified is None or isinstance(layout.unified, bool))
        and s.name == file_name(layout, s.chain)
    )


def belongs(s: Snapshot, model_id: str, chain: int) -> bool:
    """Whether ``s`` is a snapshot of the model and prefix an index key names (``index_key``)."""
    return s.layout.model_id == model_id and chain in s.keys


def lookup_keys(
    fp: Fingerprint, model_id: str, min_estimate: int, max_estimate: int | None = None
) -> list[tuple[int, str]]:
    """(segments, index key) for every prefix of ``fp`` big enough to be a snapshot and, with
    ``max_estimate``, small enough to fit a slot (a prompt of many thousand short messages
    would otherwise ask for a key per message)."""
    out = []
    for i, (h, t) in enumerate(zip(fp.hashes, fp.tokens, strict=True)):
        if max_estimate is not None and t > max_estimate:
            break  # cumulative: every later prefix is larger
        if t >= min_estimate:
            out.append((i + 1, index_key(model_id, h)))
    return out


@dataclass(frozen=True)
class BackendDisk:
    """What the lookup needs of one backend."""

    index: int
    directory: str
    layout: Layout | None  # None until its /props were read
    prefill_tps: float  # measured prompt tokens per second
    restore_bps: float  # measured restore bytes per second


@dataclass(frozen=True)
class Offer:
    snapshot: Snapshot
    reuse: int  # estimated tokens the restore provides
    cost: float  # restore time in prefill-token equivalents
    segments: int  # segments of the request the snapshot is known to hold


@dataclass(frozen=True)
class Lookup:
    offers: dict[int, Offer]  # backend index -> best restorable snapshot there
    refused: int  # snapshots of the prefix that some backend could not take (layout)
    found: list[Snapshot] = field(default_factory=list)  # every one looked at


def offers(
    fp: Fingerprint,
    found: Mapping[int, Sequence[Snapshot]],
    backends: Sequence[BackendDisk],
    keep: float = 0.0,
) -> Lookup:
    """Best snapshot per backend from ``found`` (segments -> indexed snapshots). ``keep``:
    under cache isolation, the least share of a snapshot the request must keep; of a file
    it keeps less of (a whole slot matched only up to its first user message), the server
    would consult its RAM prompt cache, which holds every tenant's sessions."""
    result: dict[int, Offer] = {}
    refused = 0
    for backend in backends:
        if backend.layout is None:
            continue
        for segments in sorted(found, reverse=True):
            usable = [s for s in found[segments] if s.directory == backend.directory]
            fitting = [s for s in usable if not s.bad and not s.layout.refusal(backend.layout)]
            refused += sum(1 for s in usable if not s.bad and s.layout.refusal(backend.layout))
            reuse = min(fp.tokens_at(segments), fp.total - 1)
            fitting = [s for s in fitting if reuse >= keep * s.estimate]
            if fitting:
                snap = fitting[0]
                seconds = snap.nbytes / max(backend.restore_bps, 1.0)
                cost = seconds * backend.prefill_tps
                result[backend.index] = Offer(snap, reuse, cost, segments)
                break
    return Lookup(result, refused, [s for entries in found.values() for s in entries])


def restore_failed(restored: int, cached: int, prompt: int) -> bool:
    """A restore followed by a re-prefill: the server reused under half of what it loaded."""
    expected = min(restored, prompt - 1)
    return expected > 0 and cached < expected / 2


def touched(snapshot: Snapshot, now: float) -> Snapshot:
    return replace(snapshot, last_used=now, hits=snapshot.hits + 1)


def evictions(entries: Sequence[Snapshot], budget: int) -> list[Snapshot]:
    """Least recently used snapshots to drop from one directory to fit ``budget`` bytes."""
    total = sum(e.nbytes for e in entries)
    out: list[Snapshot] = []
    for entry in sorted(entries, key=lambda e: (e.bad is False, e.last_used, e.name)):
        if total <= budget:
            break
        out.append(entry)
        total -= entry.nbytes
    return out


@dataclass(frozen=True)
class Stray:
    """A snapshot file in a directory that the index does not list."""

    name: str
    nbytes: int
    mtime: float  # seconds, the file's modification time


def stray_evictions(
    entries: Sequence[Snapshot], strays: Sequence[Stray], budget: int
) -> list[Stray]:
    """Strays to delete, oldest first, while indexed snapshots and strays together exceed
    ``budget`` (the indexed ones are then evicted by ``evictions`` as usual)."""
    total = sum(e.nbytes for e in entries) + sum(s.nbytes for s in strays)
    out: list[Stray] = []
    for stray in sorted(strays, key=lambda s: (s.mtime, s.name)):
        if total <= budget:
            break
        out.append(stray)
        total -= stray.nbytes
    return out
