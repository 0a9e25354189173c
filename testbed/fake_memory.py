"""The fake llama-server's KV memory kinds: dense, sliding-window (SWA) and recurrent/hybrid.

llama-server (b11434, ``server-context.cpp`` ``update_slots``) reuses a slot's common prefix
only where its memory still holds it. A dense KV cache holds every position. A sliding-window
cache keeps a ring of ``cells`` positions (``n_swa + n_ubatch``, padded to 256, per slot),
and a recurrent (or hybrid) one only the state after its last token. After the longest common
prefix ``n_past`` is found, the server takes

    thold = max(0, n_past - n_swa - (0 if new tokens follow else 1))

and, if the slot's oldest position ``pos_min`` is at or past ``thold``, needs a *context
checkpoint*: the newest one whose ``pos_max`` is at most ``n_past`` and whose ``pos_min`` is
below ``thold`` (or 0). A checkpoint restores the state before its ``n_tokens`` (SWA: one
fewer, ``min(n_past, max(pos_min + 1, pos_max))``); without one, the whole prompt is
processed again. Checkpoints past the new end are dropped.

A prompt is processed in batches that end at ``n_batch`` tokens, just before a user message's
start (the last user message always, another only if no checkpoint exists yet or the last is
``checkpoint_min_step`` behind), and ``4 + n_ubatch`` and ``4`` tokens before the prompt's
end. Before each batch is decoded, a checkpoint of the memory so far is taken when the batch
starts a user message, is near the prompt's end (less than ``n_ubatch`` tokens left after it)
or ends the prompt, and the memory is not empty; at most ``ctx_checkpoints`` are kept per slot
(when full, one within ``checkpoint_min_step`` of an earlier one from another task goes
first, then the oldest). SWA ``pos_min`` is ``max(pos_min, length - cells)``; a recurrent
state's is ``length - 1``.

A slot restored from a save file (or a prompt-cache entry) holds only the last ``n_swa``
positions of its SWA layers (the masked ones are not written), so ``pos_min = length - n_swa``
and a restored SWA slot is never reused without ``swa_full``; with ``swa_full`` the server's
``n_swa`` is 0 (no checkpoints, dense reuse of a live slot), and a restored slot is reused when
the prompt diverges within its last ``n_swa`` positions. A save file carries no checkpoints;
a prompt-cache entry carries its slot's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

DENSE, SWA, RECURRENT = "dense", "swa", "recurrent"  # recurrent: hybrid models too


@dataclass(frozen=True)
class Memory:
    """The model's memory kind and the server's flags that shape reuse."""

    kind: str = DENSE
    n_swa: int = 0  # the model's window (SWA only)
    swa_full: bool = False  # --swa-full
    n_ubatch: int = 512  # -ub
    n_batch: int = 2048  # -b
    ctx_checkpoints: int = 32  # --ctx-checkpoints
    checkpoint_min_step: int = 8192  # --checkpoint-min-step
    cells: int | None = None  # SWA ring size per slot (None: as the server sizes it)

    @property
    def server_n_swa(self) -> int:
        return self.n_swa if self.kind == SWA and not self.swa_full else 0

    @property
    def checkpoints(self) -> bool:
        return self.ctx_checkpoints > 0 and (self.kind == RECURRENT or self.server_n_swa > 0)

    def ring(self) -> int:
        if self.swa_full:
            return 1 << 40
        return self.cells or -(-(self.n_swa + self.n_ubatch) // 256) * 256


@dataclass
class Checkpoint:
    n_tokens: int
    pos_min: int
    pos_max: int
    task: int


@dataclass
class SlotMemory:
    """A slot's memory: its oldest position held (-1: empty) and its checkpoints."""

    pos_min: int = -1
    checkpoints: list[Checkpoint] = field(default_factory=list)
    length: int = 0  # the token count ``pos_min`` was last brought up to

    def sync(self, mem: Memory, length: int) -> None:
        """Catch up with a slot now holding ``length`` tokens (decoded since, or cleared)."""
        if length == 0:
            self.pos_min, self.checkpoints = (-1, []) if self.length else (-1, self.checkpoints)
        elif mem.kind == RECURRENT:
            self.pos_min = length - 1
        elif mem.kind == SWA:
            self.pos_min = max(self.pos_min, 0, length - mem.ring())
        self.length = length

    def restored(self, mem: Memory, length: int, checkpoints: bool) -> None:
        """Loaded from a save file (no checkpoints) or a prompt-cache entry (with them)."""
        if mem.kind == SWA:
            self.pos_min = max(0, length - mem.n_swa)
        self.checkpoints = self.checkpoints if checkpoints else []
        self.sync(mem, length)

    def snapshot(self) -> SlotMemory:
        return copy.deepcopy(self)


def reuse(mem: Memory, state: SlotMemory, n_past: int, n_prompt: int) -> int:
    """The prefix the server keeps of a common prefix of ``n_past`` tokens."""
    if mem.kind == DENSE:
        return n_past
    pos_next = n_past
    thold = max(0, pos_next - mem.server_n_swa - (0 if n_past < n_prompt else 1))
    if 0 < n_past <= state.length and state.pos_min >= thold:
        usable = [
            c
            for c in state.checkpoints
            if c.pos_max <= pos_next and (c.pos_min < thold or c.pos_min == 0)
        ]
        if usable:
            found = usable[-1]
            pos_next = min(pos_next, max(found.pos_min + 1, found.pos_max))
            n_past = min(pos_next, found.n_tokens)
            state.pos_min = found.pos_min
        else:
            pos_next = n_past = 0
    state.checkpoints = [c for c in state.checkpoints if c.pos_max <= pos_next]
    return n_past


def prefill(
    mem: Memory, state: SlotMemory, n_past: int, n_prompt: int, users: list[int], task: int
) -> None:
    """Process prompt tokens ``n_past..n_prompt`` batch by batch, taking checkpoints."""
    if n_past == 0:  # the memory is emptied; checkpoints at position 0 stay
        state.pos_min, state.length = -1, 0
    state.sync(mem, n_past)
    last_user = users[-1] if users else -1
    n = n_past
    while n < n_prompt:
        start = n
        while n < n_prompt and n - start < mem.n_batch:
            n += 1
            if mem.checkpoints and n in users:
                cps = state.checkpoints
                step = cps[-1].n_tokens + mem.checkpoint_min_step if cps else 0
                if n == last_user or not cps or n > step:
                    break
            if mem.checkpoints and n_prompt - n in (min(mem.n_batch, 4 + mem.n_ubatch), 4):
                break
        _checkpoint(mem, state, start, n, n_prompt, start == last_user, start in users, task)
        state.sync(mem, n)


def _checkpoint(
    mem: Memory,
    state: SlotMemory,
    start: int,
    end: int,
    n_prompt: int,
    last_user: bool,
    user: bool,
    task: int,
) -> None:
    near_end = n_prompt < end + mem.n_ubatch
    if not mem.checkpoints or state.pos_min < 0:
        return
    if end < n_prompt and not user and not near_end:
        return
    cps = state.checkpoints
    if cps and not (last_user or near_end or start > cps[-1].n_tokens + mem.checkpoint_min_step):
        return
    i, last = 0, -1  # when full, drop one within min-step of an earlier one (another task's)
    while len(cps) + 1 >= mem.ctx_checkpoints and i < len(cps):
        if cps[i].task != task and last >= 0 and cps[i].n_tokens <= last + mem.checkpoint_min_step:
            del cps[i]
            continue
        last, i = cps[i].n_tokens, i + 1
    while len(cps) >= mem.ctx_checkpoints:
        cps.pop(0)
    cps[:] = [c for c in cps if c.n_tokens != start]
    cps.append(Checkpoint(start, state.pos_min, start - 1, task))


def user_starts(tokens: list[str]) -> list[int]:
    """Where user messages start (the template's ``<|im_start|>user`` delimiter)."""
    return [
        i for i in range(len(tokens) - 1) if tokens[i] == "<|im_start|>" and tokens[i + 1] == "user"
    ]
