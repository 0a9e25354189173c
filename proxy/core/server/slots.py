"""The state of backends and slots as the proxy sees them (plain data; ``core.server.fleet``
changes it).

State per backend: a phase (UNKNOWN until probed, READY, LOADING while llama-server loads
its model, DOWN when unreachable), an ``epoch`` that increases whenever the backend's slot
contents can no longer be trusted (it restarted, or came back with no way to tell), and
its slots. Each slot is in one phase:

- IDLE: nothing of ours or anyone's runs on it; it may be pinned.
- BUSY: a request of ours runs on it.
- DRAINING: a request of ours was aborted; llama-server notices a closed connection only by
  polling (about 1 s), so the slot stays unpinnable until ``/slots`` shows it idle.
- EXTERNAL: ``/slots`` shows it processing but we sent nothing: someone else uses the server.
- REMOTE: another proxy replica holds its lease (shared state in Redis). When the store goes
  away that lease can no longer be seen to end: the slot drains like an aborted one.

The one safety rule, from llama-server's busy-slot pinning bug (a request pinned with
``id_slot`` to a slot that is generating can overwrite that slot's KV with another
conversation's): only an IDLE slot is ever placed. Every other phase blocks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.prompt.usage import Usage
from proxy.core.server.ram_cache import RamEntry

# A backend's rates (prefill tokens/s, restore bytes/s, a request's hold on its slot) are
# means over its recent responses, each weighted this much against what came before: the
# last five or so dominate, so a rate follows a change of load within a few requests.
SAMPLE_WEIGHT = 0.2


def measured(previous: float | None, sample: float) -> float:
    """A rate updated with one more response's ``sample`` (the first sets it)."""
    return sample if previous is None else (1 - SAMPLE_WEIGHT) * previous + SAMPLE_WEIGHT * sample


class BackendPhase(StrEnum):
    UNKNOWN = "unknown"
    READY = "ready"
    LOADING = "loading"
    DOWN = "down"


class SlotPhase(StrEnum):
    IDLE = "idle"
    BUSY = "busy"
    DRAINING = "draining"
    EXTERNAL = "external"
    REMOTE = "remote"


@dataclass(frozen=True)
class SlotProbe:
    id: int
    processing: bool
    n_tokens: int
    task_id: int


@dataclass(frozen=True)
class Probe:
    """What one round of ``/health`` + ``/props`` (+ ``/slots``) said about a backend.
    ``read=False``: ``/slots`` was not read (not needed, disabled, or the server sleeps), so
    ``slots`` only counts them; ``sleeping``: ``/props`` says ``is_sleeping``; ``identity``:
    what it runs, from ``/props``."""

    phase: BackendPhase
    slots: tuple[SlotProbe, ...] = ()
    read: bool = True
    sleeping: bool = False
    # what ``/props`` says the server runs (model path and type, context, slots, build); a
    # change is a restart whatever else a probe saw (None: not told)
    identity: tuple[str, ...] | None = None


class Undo(NamedTuple):
    """What a claim changed, for a claim given back unsent (nothing reached the server):
    the slot's last use (a fresh one would start a hold for a session long gone), and the
    backend's RAM-cache model before and after the claim parked the slot's content and
    took out the entry the server would load (put back only while no other claim or
    release followed on the backend, and the model is the claim's list)."""

    last_used: float
    ram_before: list[RamEntry]
    ram_after: list[RamEntry]
    turn: int  # the backend's ``turns`` after the claim


@dataclass
class SlotState:
    id: int
    phase: SlotPhase = SlotPhase.IDLE
    last_used: float = 0.0
    n_tokens: int = 0  # real KV length, from responses and /slots
    content: Fingerprint | None = None  # what the KV holds, as a prompt fingerprint
    pending: Fingerprint | None = None  # the prompt in flight on it, while BUSY
    record_at: float = 0.0  # wall time of the shared record this content matches
    remote_since: float = 0.0  # when a view first showed another replica's lease on it
    owner: str | None = None  # tenant whose request wrote the KV (cache isolation)
    # what the claim in flight changed, undone if it is given back unsent (``Undo``)
    undo: Undo | None = field(default=None, compare=False, repr=False)
    # (content, RAM cache) as this idle slot was last saved to the cache: the same two
    # objects mean the same save, which changes nothing (``Fleet._save_idle``)
    saved: tuple[Fingerprint, list[RamEntry]] | None = field(
        default=None, compare=False, repr=False
    )

    def __setattr__(self, name: str, value: object) -> None:
        # every change of a slot is a change of its backend (``BackendState.version``)
        object.__setattr__(self, name, value)
        backend = self.__dict__.get("_backend")
        if backend is not None:
            backend.__dict__["version"] += 1

    @property
    def expected(self) -> Fingerprint | None:
        """What the KV will hold when the request in flight (if any) is done."""
        return self.pending if self.pending is not None else self.content


@dataclass
class BackendState:
    index: int
    label: str
    phase: BackendPhase = BackendPhase.UNKNOWN
    epoch: int = 0
    max_task_id: int = -1
    exact: bool = False  # reuse only as an exact extension (hybrid/recurrent/SWA models)
    reuse_known: bool = True  # ``exact`` is configured or probed (``core.server.reuse_rules``)
    ram: bool = True  # runs llama-server's host-RAM prompt cache (default --cache-ram)
    ram_tokens: int | None = None  # what that cache holds, in tokens (None: not bounded)
    idle_saves: bool = True  # --cache-idle-slots: every idle slot is saved as a task starts
    unified: bool = False  # unified KV (-kvu): an idle slot so saved is also cleared
    unread: bool = False  # work was sent to it since ``/slots`` was last read
    asleep: bool = False  # --sleep-idle-seconds: sleeping, its context destroyed
    identity: tuple[str, ...] | None = None  # the last ``Probe.identity`` seen
    prefill_tps: float = 1000.0  # prompt tokens computed per second (timings.prompt_ms, EMA)
    token_scale: float | None = None  # its tokens per fingerprint estimate (EMA)
    slots: list[SlotState] = field(default_factory=list)  # replaced, not mutated
    ram_entries: list[RamEntry] = field(default_factory=list)  # oldest first; replaced, not mutated
    turns: int = field(default=0, compare=False, repr=False)  # claims and releases of its slots
    # bumped by every change of the backend or of one of its slots: what is derived from them
    # (``core.routing.index``) holds while it is the same
    version: int = field(default=0, compare=False, repr=False)

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name == "slots":  # its slots report their changes to it
            for slot in self.slots:
                slot.__dict__["_backend"] = self
        if name != "version":
            object.__setattr__(self, "version", self.__dict__.get("version", 0) + 1)

    def idle_slots(self) -> list[SlotState]:
        return [s for s in self.slots if s.phase is SlotPhase.IDLE]

    def busy_count(self) -> int:
        return sum(1 for s in self.slots if s.phase is not SlotPhase.IDLE)

    def from_estimate(self, tokens: int) -> int:  # in this server's tokens (learned scale)
        return round(tokens * (self.token_scale or 1.0))

    def kv_tokens(self, content: Fingerprint, n_tokens: int = 0) -> int:
        return n_tokens if n_tokens > 0 else self.from_estimate(content.total)  # known, or est.

    @property
    def primable(self) -> bool:
        """Whether a primer (``ram_cache.PRIMER``) can make the server load from its RAM cache:
        it has one, and keeps an idle slot's KV until the next task (with unified KV any task
        started in between would clear the primer, and an empty pinned slot skips the
        cache)."""
        return self.ram and not self.unified

    def kv_estimate(self, content: Fingerprint, n_tokens: int = 0) -> int:
        """What ``content`` takes in the KV, in estimate units: for a raw prompt kept with its
        reply (``sealed``), its real length (``n_tokens``) when known; else the fingerprint's
        estimate (a chat content's holds the reply; one scale for every content would be
        several times off on code)."""
        return kv_length(content, n_tokens, self.token_scale or 1.0)

    def learn(self, estimate: int, usage: Usage) -> None:
        """From a response's usage (a prompt of ``estimate`` fingerprint tokens): the prefill
        rate and the tokens per estimate."""
        if usage.prompt_ms and usage.prompt_tokens > usage.cached_tokens:
            tps = (usage.prompt_tokens - usage.cached_tokens) / (usage.prompt_ms / 1000)
            self.prefill_tps = measured(self.prefill_tps, tps)
        if estimate > 0 and usage.prompt_tokens > 0:
            self.token_scale = measured(self.token_scale, usage.prompt_tokens / estimate)

    def ram_entry(self, content: Fingerprint, at: float, n_tokens: int = 0) -> RamEntry:
        return RamEntry(content, at, self.kv_tokens(content, n_tokens))


def kv_length(content: Fingerprint, n_tokens: int | None, scale: float) -> int:
    """``BackendState.kv_estimate`` with the backend's scale given (per RAM entry, in a loop)."""
    if not n_tokens or n_tokens <= 0 or not content.sealed:
        return content.total
    return max(content.total, round(n_tokens / scale))


@dataclass(frozen=True)
class Placement:
    backend: int
    slots: tuple[int, ...]
    pin: int | None  # the id_slot to send; None when the server must choose
    from_ram: RamEntry | None = None  # the RAM-cache entry the server is predicted to load
    primed: bool = False  # a primer is sent first, so that the server loads ``from_ram``


class NoPlacement(StrEnum):
    BUSY = "busy"  # a READY backend exists; wait for a slot
    LOADING = "loading"  # none READY, some LOADING or not yet probed; wait for the model
    DOWN = "down"  # nothing is up: fail now
