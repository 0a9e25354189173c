"""Which releases can change a decision to wait (``core.routing.wakes``): a waiter filed
under none of a release's keys decides to wait again."""

from __future__ import annotations

from itertools import accumulate

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.prompt.fingerprint import Fingerprint
from proxy.core.routing.decision import Decision, RoutingParams, route
from proxy.core.routing.wakes import release_keys
from proxy.core.server.fleet import (
    BackendPhase,
    Fleet,
    Placement,
    Probe,
    SlotPhase,
    SlotProbe,
)
from proxy.core.server.ram_cache import RamEntry

PARAMS = RoutingParams(min_prefix_tokens=16, wait_min_tokens=400)


def chat(system: int, system_tokens: int, conversation: int, turns: int) -> Fingerprint:
    """A chat prompt: a system prompt (shared by its kind), the first user message (whose
    conversation it is: the anchor) and ``turns`` more messages of 60 tokens each."""
    segments = [(system,), (system, conversation), *((conversation, t) for t in range(turns))]
    keys = [tuple(segments[: i + 1]) for i in range(len(segments))]
    sizes = [system_tokens, 20, *([60] * turns)]
    return Fingerprint(tuple(map(hash, keys)), tuple(accumulate(sizes)), anchor=2)


def _active(f: Fleet) -> tuple[int, int]:
    ready = [b for b in f.backends if b.phase is BackendPhase.READY]
    return sum(len(b.idle_slots()) for b in ready), sum(len(b.slots) for b in ready)


contents = st.tuples(
    st.integers(0, 1),  # system prompt
    st.sampled_from([30, 300, 900]),  # its tokens
    st.integers(0, 3),  # conversation
    st.integers(0, 4),  # turns after the first user message
)


@settings(max_examples=1000, deadline=None, database=None)
@given(
    st.lists(st.tuples(contents, st.booleans()), min_size=4, max_size=6),  # (content, busy)
    st.lists(st.tuples(contents, st.integers(1, 3)), min_size=1, max_size=4),  # waiters
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4)), max_size=3),  # parked on b0
    st.data(),
)
def test_a_release_filed_under_none_of_a_waiters_keys_leaves_it_waiting(
    slots: list[tuple[tuple[int, int, int, int], bool]],
    prompts: list[tuple[tuple[int, int, int, int], int]],
    parked: list[tuple[int, int]],
    data: st.DataObject,
) -> None:
    f = Fleet(["b0", "b1"])
    half = (len(slots) + 1) // 2
    for b, count in enumerate((half, len(slots) - half)):
        probe = Probe(BackendPhase.READY, tuple(SlotProbe(i, False, 0, -1) for i in range(count)))
        f.apply_probe(b, probe, now=0.0)
    every = [s for b in f.backends for s in b.slots]
    for i, (slot, (content, busy)) in enumerate(zip(every, slots, strict=True)):
        slot.content, slot.last_used = chat(*content), 10.0 * i
        if busy:
            slot.phase, slot.pending = SlotPhase.BUSY, chat(*content[:3], content[3] + 1)
    # backend 0's RAM cache: earlier turns of the waiting sessions (their own, or others')
    entries = [chat(*prompts[i % len(prompts)][0][:3], turns) for i, turns in parked]
    f.backends[0].ram_entries = [RamEntry(c, 5.0, c.total) for c in entries]
    running = [(b.index, s.id) for b in f.backends for s in b.slots if s.phase is SlotPhase.BUSY]
    if not running:
        return
    waiters = [chat(*c[:3], c[3] + more) for c, more in prompts]  # sessions coming back
    queued = len(waiters)
    avoid = data.draw(st.sampled_from([frozenset(), frozenset({1})]))  # (another replica's)
    decided = [route(w, f.backends, PARAMS, now=100.0, queued=queued, avoid=avoid) for w in waiters]
    b, s = data.draw(st.sampled_from(running))
    slot = f.backends[b].slots[s]
    f.release(Placement(b, (s,), s), 100.0, clean=True, content=slot.pending)
    keys = set(release_keys(b, s, slot.content, {2}, (*_active(f), queued)))
    for prompt, first in zip(waiters, decided, strict=True):
        if not isinstance(first, Decision) or first.wakes is None or first.placement:
            continue  # placed, or filed under any release
        if first.wakes & keys:
            continue  # asked
        again = route(prompt, f.backends, PARAMS, now=100.0, queued=queued, avoid=avoid)
        assert isinstance(again, Decision)
        assert again.placement is None, (first, again)


def test_a_waiter_that_left_backends_out_is_asked_when_its_fleet_leaves_saturation() -> None:
    """Two backends of 16 slots; the second is another replica's (``avoid``), every slot of
    it busy. One slot of the first is idle: the waiter's fleet is saturated, so it waits for
    the busy slot holding its conversation. A stranger's slot frees: the waiter's fleet is no
    longer saturated (2 of 16 idle) while the whole fleet still is (2 of 32), so no key of
    the saturated bar is yielded; the waiter would now place, so it must be asked."""
    f = Fleet(["b0", "b1"])
    for b in range(2):
        probe = Probe(BackendPhase.READY, tuple(SlotProbe(i, False, 0, -1) for i in range(16)))
        f.apply_probe(b, probe, now=0.0)
    for backend in f.backends:
        for slot in backend.slots:
            slot.phase, slot.pending = SlotPhase.BUSY, chat(1, 300, 10 + slot.id, 1)
    f.backends[0].slots[0].pending = chat(0, 30, 1, 1)  # the waiter's conversation, 110 tokens
    idle = f.backends[0].slots[15]
    idle.phase, idle.pending, idle.content = SlotPhase.IDLE, None, chat(1, 300, 99, 1)
    prompt, avoid = chat(0, 30, 1, 6), frozenset({1})  # its next turn: 410 tokens
    first = route(prompt, f.backends, PARAMS, now=100.0, queued=1, avoid=avoid)
    assert isinstance(first, Decision)
    assert first.placement is None  # waits for slot 0 under the saturated fleet's lower bar
    slot = f.backends[0].slots[5]
    f.release(Placement(0, (5,), 5), 100.0, clean=True, content=slot.pending)
    again = route(prompt, f.backends, PARAMS, now=100.0, queued=1, avoid=avoid)
    assert isinstance(again, Decision)
    assert again.placement is not None  # its fleet left saturation: it places now
    keys = set(release_keys(0, 5, slot.content, {2}, (*_active(f), 1)))
    assert first.wakes is None or first.wakes & keys  # so the release asks it


@settings(max_examples=600, deadline=None, database=None)
@given(
    st.lists(
        st.tuples(contents, st.sampled_from(["busy", "left", "idle"])), min_size=4, max_size=6
    ),
    st.lists(st.tuples(contents, st.integers(1, 3)), min_size=1, max_size=4),  # waiters
    st.data(),
)
def test_a_holds_end_filed_under_none_of_a_waiters_keys_leaves_it_waiting(
    slots: list[tuple[tuple[int, int, int, int], str]],
    prompts: list[tuple[tuple[int, int, int, int], int]],
    data: st.DataObject,
) -> None:
    """On backends that cannot park a slot's content (no RAM cache), a slot its session just
    left is held from other sessions; when the hold ends, the slot is a choice again, as
    when it is released: a waiter filed under none of that release's keys
    (``wakes.release_keys``) decides to wait again (the scheduler asks only the others)."""
    from unittest import mock

    import proxy.core.routing.decision as decision
    from proxy.core.routing.returns import held as still

    f = Fleet(["b0", "b1"])
    half = (len(slots) + 1) // 2
    for b, count in enumerate((half, len(slots) - half)):
        probe = Probe(BackendPhase.READY, tuple(SlotProbe(i, False, 0, -1) for i in range(count)))
        f.apply_probe(b, probe, now=0.0)
        f.backends[b].ram = False
    every = [s for b in f.backends for s in b.slots]
    for slot, (content, state) in zip(every, slots, strict=True):
        slot.content, slot.last_used = chat(*content), 99.9 if state == "left" else 10.0
        if state == "busy":
            slot.phase, slot.pending = SlotPhase.BUSY, chat(*content[:3], content[3] + 1)
    left = [(b.index, s.id) for b in f.backends for s in b.slots if s.last_used > 99.0]
    if not left:
        return
    waiters = [chat(*c[:3], c[3] + more) for c, more in prompts]  # sessions coming back
    queued = len(waiters)

    def decide(prompt: Fingerprint) -> object:
        return route(prompt, f.backends, PARAMS, now=100.0, queued=queued, hold=5.0)

    decided = [decide(w) for w in waiters]
    b, s = data.draw(st.sampled_from(left))
    ended = f.backends[b].slots[s]
    keys = set(release_keys(b, s, ended.content, {2}, (*_active(f), queued)))

    def held_but_the_ended(backend, slot, *args):  # type: ignore[no-untyped-def]
        return slot is not ended and still(backend, slot, *args)

    for prompt, first in zip(waiters, decided, strict=True):
        if not isinstance(first, Decision) or first.wakes is None or first.placement:
            continue  # placed, or filed under any release (waiting behind holds among them)
        if first.wakes & keys:
            continue  # asked
        with mock.patch.object(decision, "held", held_but_the_ended):
            again = decide(prompt)
        assert isinstance(again, Decision)
        assert again.placement is None, (first, again)
