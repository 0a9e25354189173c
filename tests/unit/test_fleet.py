from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.prompt.fingerprint import Fingerprint, fingerprint_chat
from proxy.core.server.fleet import (
    BackendPhase,
    Fleet,
    NoPlacement,
    Placement,
    Probe,
    SlotPhase,
    SlotProbe,
)
from proxy.core.server.placement import Need, pick_backend, place
from proxy.core.server.ram_cache import RamEntry


def ready_fleet(*slot_counts: int) -> Fleet:
    fleet = Fleet([f"b{i}" for i in range(len(slot_counts))])
    for index, count in enumerate(slot_counts):
        slots = tuple(SlotProbe(i, False, 0, -1) for i in range(count))
        fleet.apply_probe(index, Probe(BackendPhase.READY, slots), now=0.0)
    return fleet


def ready_probe(count: int) -> tuple[SlotProbe, ...]:
    return tuple(SlotProbe(i, False, 0, -1) for i in range(count))


def phase_of(fleet: Fleet, backend: int = 0, slot: int = 0) -> SlotPhase:
    """A slot's phase, read anew (each call may follow a change of it)."""
    return fleet.backends[backend].slots[slot].phase


def test_least_busy_backend_then_least_recently_used_slot() -> None:
    fleet = ready_fleet(2, 2)
    fleet.claim(Placement(0, (0,), 0), now=1.0)
    fleet.backends[1].slots[0].last_used = 5.0
    assert place(fleet.backends, Need()) == Placement(1, (1,), 1)


def test_exclusive_needs_a_fully_idle_backend() -> None:
    fleet = ready_fleet(2, 2)
    fleet.claim(Placement(0, (1,), 1), now=1.0)
    assert place(fleet.backends, Need(exclusive=True)) == Placement(1, (0, 1), None)
    fleet.claim(Placement(1, (0,), 0), now=1.0)
    assert place(fleet.backends, Need(exclusive=True)) is NoPlacement.BUSY


def test_wanted_slot_only_when_idle() -> None:
    fleet = ready_fleet(2)
    assert place(fleet.backends, Need(slot=1)) == Placement(0, (1,), 1)
    fleet.claim(Placement(0, (1,), 1), now=1.0)
    assert place(fleet.backends, Need(slot=1)) is NoPlacement.BUSY


def test_reasons_when_nothing_fits() -> None:
    fleet = Fleet(["a", "b"])
    assert place(fleet.backends, Need()) is NoPlacement.LOADING  # not probed yet
    fleet.apply_probe(0, Probe(BackendPhase.DOWN), now=0.0)
    fleet.apply_probe(1, Probe(BackendPhase.LOADING), now=0.0)
    assert place(fleet.backends, Need()) is NoPlacement.LOADING
    fleet.apply_probe(1, Probe(BackendPhase.DOWN), now=0.0)
    assert place(fleet.backends, Need()) is NoPlacement.DOWN
    assert pick_backend(fleet.backends, frozenset()) is NoPlacement.DOWN


def test_avoided_backend_is_skipped() -> None:
    fleet = ready_fleet(1, 1)
    assert place(fleet.backends, Need(avoid=frozenset({0}))) == Placement(1, (0,), 0)
    assert pick_backend(fleet.backends, frozenset({0})) == 1


def test_claiming_a_busy_slot_is_refused() -> None:
    fleet = ready_fleet(1)
    fleet.claim(Placement(0, (0,), 0), now=1.0)
    with pytest.raises(ValueError, match="busy"):
        fleet.claim(Placement(0, (0,), 0), now=2.0)


def test_a_claim_given_back_unsent_leaves_the_slot_as_it_was() -> None:
    """Its last use too: a fresh one would hold the slot for a session that left long ago
    (``core.routing.returns``)."""
    fleet = ready_fleet(1)
    slot, placement = fleet.backends[0].slots[0], Placement(0, (0,), 0)
    slot.content, slot.last_used = Fingerprint((1, 2), (100, 200)), 5.0
    fleet.claim(placement, now=100.0, content=Fingerprint((7,), (50,)))
    assert slot.last_used == 100.0
    fleet.release(placement, now=100.1, clean=True, sent=False)
    assert (slot.phase, slot.content) == (SlotPhase.IDLE, Fingerprint((1, 2), (100, 200)))
    assert slot.last_used == 5.0
    fleet.claim(placement, now=200.0)
    fleet.release(placement, now=201.0, clean=True)  # sent: used then
    assert slot.last_used == 201.0


def test_a_claim_given_back_unsent_leaves_the_ram_model_as_it_was() -> None:
    """The claim parked the slot's content and took out the entry the server would load:
    neither happened, since nothing reached the server. After a later change of the model
    (another claim), the claim's own changes stay: they cannot be told apart any more."""
    fleet = ready_fleet(2)
    backend = fleet.backends[0]
    parked = RamEntry(Fingerprint((5, 6), (100, 200)), 1.0)
    backend.ram_entries = [parked]
    for slot, first in zip(backend.slots, (1, 3), strict=True):
        slot.content, slot.last_used = Fingerprint((first, first + 1), (100, 200)), 5.0
    before = backend.ram_entries
    placement = Placement(0, (0,), 0, parked)
    fleet.claim(placement, now=100.0, content=Fingerprint((5, 6, 7), (100, 200, 300)))
    assert parked not in backend.ram_entries  # loaded into the slot
    fleet.release(placement, now=100.1, clean=True, sent=False)
    assert backend.ram_entries is before
    fleet.claim(placement, now=110.0, content=Fingerprint((5, 6, 7), (100, 200, 300)))
    other = Placement(0, (1,), 1)
    fleet.claim(other, now=111.0, content=Fingerprint((9,), (100,)))
    after = backend.ram_entries
    fleet.release(placement, now=112.0, clean=True, sent=False)
    assert backend.ram_entries is after


def test_aborted_slot_drains_until_a_probe_shows_it_idle() -> None:
    fleet = ready_fleet(1)
    placement = Placement(0, (0,), 0)
    fleet.claim(placement, now=1.0)
    fleet.release(placement, now=2.0, clean=False)
    assert fleet.backends[0].slots[0].phase is SlotPhase.DRAINING
    assert fleet.is_draining(0)
    busy = Probe(BackendPhase.READY, (SlotProbe(0, True, 10, 3),))
    fleet.apply_probe(0, busy, now=3.0)
    assert place(fleet.backends, Need()) is NoPlacement.BUSY
    idle = Probe(BackendPhase.READY, (SlotProbe(0, False, 10, 3),))
    fleet.apply_probe(0, idle, now=4.0)
    assert place(fleet.backends, Need()) == placement


def test_a_drain_given_up_leaves_slot_external_until_probed_idle() -> None:
    fleet = ready_fleet(1)
    placement = Placement(0, (0,), 0)
    fleet.claim(placement, now=1.0)
    fleet.release(placement, now=2.0, clean=False)
    assert fleet.recast(SlotPhase.DRAINING, SlotPhase.EXTERNAL, 0) == [0]
    assert fleet.backends[0].slots[0].phase is SlotPhase.EXTERNAL


def test_foreign_traffic_blocks_a_slot_but_a_stale_probe_does_not() -> None:
    fleet = ready_fleet(2)
    placement = Placement(0, (0,), 0)
    fleet.claim(placement, now=1.0)
    fleet.release(placement, now=5.0, clean=True)
    seen = (SlotProbe(0, True, 5, 1), SlotProbe(1, True, 5, 2))
    fleet.apply_probe(0, Probe(BackendPhase.READY, seen), now=4.0)  # sent before release
    assert fleet.backends[0].slots[0].phase is SlotPhase.IDLE
    assert fleet.backends[0].slots[1].phase is SlotPhase.EXTERNAL


@pytest.mark.parametrize(
    "probe",
    [
        pytest.param(Probe(BackendPhase.READY, (SlotProbe(0, False, 0, 1),)), id="task-ids-reset"),
        pytest.param(
            Probe(BackendPhase.READY, tuple(SlotProbe(i, False, 0, 9) for i in range(3))),
            id="slot-count-changed",
        ),
    ],
)
def test_restart_detected(probe: Probe) -> None:
    fleet = ready_fleet(2)
    fleet.apply_probe(0, Probe(BackendPhase.READY, (SlotProbe(0, False, 9, 7),) * 2), now=1.0)
    epoch = fleet.backends[0].epoch
    assert fleet.apply_probe(0, probe, now=2.0)
    assert fleet.backends[0].epoch == epoch + 1
    assert len(fleet.backends[0].slots) == len(probe.slots)


def test_return_from_down_invalidates_and_keeps_our_claims() -> None:
    fleet = ready_fleet(2)
    fleet.claim(Placement(0, (1,), 1), now=1.0)
    fleet.mark_down(0)
    assert fleet.apply_probe(0, Probe(BackendPhase.READY, ready_probe(2)), now=2.0)
    assert [s.phase for s in fleet.backends[0].slots] == [SlotPhase.IDLE, SlotPhase.BUSY]


CONTENT = fingerprint_chat({"messages": [{"role": "user", "content": "held " * 90}]}, len)


def served_fleet() -> Fleet:
    """One backend of two slots that ran tasks 7 and 8, each slot holding a tenant's
    content, with one RAM cache entry: what a return keeps or a restart forgets."""
    fleet = ready_fleet(2)
    seen = (SlotProbe(0, False, 90, 7), SlotProbe(1, False, 90, 8))
    fleet.apply_probe(0, Probe(BackendPhase.READY, seen), now=1.0)
    backend = fleet.backends[0]
    for slot in backend.slots:
        slot.content, slot.n_tokens, slot.owner = CONTENT, 90, "tenant"
    backend.ram_entries = [RamEntry(CONTENT, at=0.5)]
    fleet.mark_down(0)
    return fleet


def test_a_return_without_sign_of_a_restart_keeps_what_the_slots_hold() -> None:
    """A probe timed out or a connection failed, and the server is back with the task ids
    it had: the same process, with the same KV."""
    fleet = served_fleet()
    epoch = fleet.backends[0].epoch
    seen = (SlotProbe(0, False, 90, 7), SlotProbe(1, False, 90, 8))
    assert not fleet.apply_probe(0, Probe(BackendPhase.READY, seen), now=2.0)
    backend = fleet.backends[0]
    assert backend.phase is BackendPhase.READY
    assert backend.epoch == epoch
    assert [(s.content, s.owner) for s in backend.slots] == [(CONTENT, "tenant")] * 2
    assert len(backend.ram_entries) == 1


def test_a_slot_that_ran_a_task_unseen_while_away_is_forgotten() -> None:
    fleet = served_fleet()
    seen = (SlotProbe(0, False, 90, 7), SlotProbe(1, False, 120, 11))  # someone used slot 1
    assert not fleet.apply_probe(0, Probe(BackendPhase.READY, seen), now=2.0)
    backend = fleet.backends[0]
    assert (backend.slots[0].content, backend.slots[0].owner) == (CONTENT, "tenant")
    assert (backend.slots[1].content, backend.slots[1].owner) == (None, None)


@pytest.mark.parametrize(
    "probe",
    [
        pytest.param(Probe(BackendPhase.READY, ready_probe(2)), id="no-task-ids"),
        pytest.param(
            Probe(BackendPhase.READY, (SlotProbe(0, False, 0, 2), SlotProbe(1, False, 0, -1))),
            id="task-ids-went-down",
        ),
        pytest.param(Probe(BackendPhase.READY, ready_probe(3)), id="slot-count-changed"),
        pytest.param(Probe(BackendPhase.READY, ready_probe(2), read=False), id="slots-unread"),
    ],
)
def test_a_return_with_sign_of_a_restart_or_none_to_read_forgets_it_all(probe: Probe) -> None:
    fleet = served_fleet()
    epoch = fleet.backends[0].epoch
    assert fleet.apply_probe(0, probe, now=2.0)
    backend = fleet.backends[0]
    assert backend.epoch == epoch + 1
    assert backend.ram_entries == []
    assert all(s.content is None and s.owner is None for s in backend.slots)


def test_a_return_counts_as_a_restart_when_no_task_id_was_ever_seen() -> None:
    """Content only restored into its slots (a restore runs no task on a slot): a fresh
    server would look the same."""
    fleet = ready_fleet(1)
    fleet.backends[0].slots[0].content = CONTENT
    fleet.mark_down(0)
    assert fleet.apply_probe(0, Probe(BackendPhase.READY, ready_probe(1)), now=2.0)
    assert fleet.backends[0].slots[0].content is None


def test_a_backend_that_loaded_its_model_again_restarted() -> None:
    fleet = served_fleet()
    fleet.apply_probe(0, Probe(BackendPhase.LOADING), now=2.0)
    seen = (SlotProbe(0, False, 90, 7), SlotProbe(1, False, 90, 8))
    assert fleet.apply_probe(0, Probe(BackendPhase.READY, seen), now=3.0)
    assert all(s.content is None for s in fleet.backends[0].slots)


@st.composite
def fleets(draw: st.DrawFn) -> Fleet:
    counts = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    fleet = ready_fleet(*counts)
    for backend in fleet.backends:
        if draw(st.booleans()):
            backend.phase = draw(st.sampled_from(list(BackendPhase)))
        for slot in backend.slots:
            slot.phase = draw(st.sampled_from(list(SlotPhase)))
            slot.last_used = draw(st.floats(0, 100))
    return fleet


@given(fleets(), st.booleans(), st.sets(st.integers(0, 3)))
def test_property_never_places_a_slot_that_is_not_idle(
    fleet: Fleet, exclusive: bool, avoid: set[int]
) -> None:
    result = place(fleet.backends, Need(exclusive=exclusive, avoid=frozenset(avoid)))
    if isinstance(result, Placement):
        backend = fleet.backends[result.backend]
        assert backend.phase is BackendPhase.READY
        assert result.backend not in avoid
        assert all(backend.slots[i].phase is SlotPhase.IDLE for i in result.slots)
        fleet.claim(result, now=101.0)  # and claiming it never raises
    else:
        usable = [b for b in fleet.backends if b.index not in avoid]
        fits = [
            b
            for b in usable
            if b.phase is BackendPhase.READY
            and (all if exclusive else any)(s.phase is SlotPhase.IDLE for s in b.slots)
        ]
        assert fits == []


@given(fleets())
def test_property_placement_is_deterministic(fleet: Fleet) -> None:
    assert place(fleet.backends, Need()) == place(fleet.backends, Need())


def test_probe_trims_a_slot_to_its_kv_length_and_keeps_the_conversation_anchor() -> None:
    """/slots reports fewer tokens than the proxy believed (the server dropped a tail): the
    content is cut to that share, and still tells a stranger from the session it belongs to."""
    messages = [
        {"role": "system", "content": "s " * 40},
        {"role": "user", "content": "u " * 40},
        {"role": "assistant", "content": "a " * 40},
        {"role": "user", "content": "v " * 40},
    ]
    content = fingerprint_chat({"messages": messages}, lambda text: len(text.split()))
    assert content.anchor == 3
    fleet = ready_fleet(1)
    fleet.claim(Placement(0, (0,), 0), now=1.0, content=content)
    fleet.release(Placement(0, (0,), 0), now=2.0, clean=True, content=content, n_tokens=100)
    fleet.apply_probe(0, Probe(BackendPhase.READY, (SlotProbe(0, False, 60, 3),)), now=3.0)
    trimmed = fleet.backends[0].slots[0].content
    assert trimmed is not None
    assert trimmed.hashes == content.hashes[:3]
    assert trimmed.anchor == content.anchor
    assert not trimmed.same_conversation(2)  # shares only the system prompt: a stranger
    assert trimmed.same_conversation(3)


def test_a_release_without_a_reported_length_forgets_the_old_one() -> None:
    """The slot's KV length is the last response's: a response without usage leaves it
    unknown (estimated from the content), never the previous content's length."""
    first = fingerprint_chat({"messages": [{"role": "user", "content": "a " * 40}]}, len)
    second = fingerprint_chat({"messages": [{"role": "user", "content": "b " * 40}]}, len)
    fleet = ready_fleet(1)
    backend, where = fleet.backends[0], Placement(0, (0,), 0)
    fleet.claim(where, now=1.0, content=first)
    fleet.release(where, now=2.0, clean=True, content=first, n_tokens=500)
    assert backend.kv_tokens(first, backend.slots[0].n_tokens) == 500
    fleet.claim(where, now=3.0, content=second)
    fleet.release(where, now=4.0, clean=True, content=second)
    slot = backend.slots[0]
    assert slot.content == second
    assert backend.kv_tokens(second, slot.n_tokens) == backend.from_estimate(second.total)


def test_another_replicas_newer_record_dates_the_slots_last_use() -> None:
    """A slot record written by another replica 0.5 s ago (wall clock) means its request left
    the slot then: the slot's last use moves to that moment on this replica's clock."""
    content = fingerprint_chat({"messages": [{"role": "user", "content": "a " * 40}]}, len)
    fleet = ready_fleet(2)
    fleet.backends[0].slots[0].last_used = 3.0
    fleet.fold_shared(0, set(), {0: (content, 40, 1000.0)}, now=50.0, wall=1000.5)
    slot = fleet.backends[0].slots[0]
    assert slot.content == content
    assert slot.last_used == 49.5
    fleet.fold_shared(0, set(), {0: (content, 40, 999.0)}, now=60.0, wall=1001.0)
    assert slot.last_used == 49.5  # an older record changes nothing


def test_another_replicas_record_shorter_than_a_parked_entry_is_folded_in() -> None:
    """A RAM entry of more segments than another replica's new record for a slot: whether
    the record loaded it is asked of entries it contains only (every such fold raised an
    IndexError, and the replica's maintenance rounds and requests that read the view failed)."""
    long, short = (
        fingerprint_chat({"messages": [{"role": "user", "content": f"{w} " * 30}] * n}, len)
        for w, n in (("x", 6), ("y", 1))
    )
    fleet = ready_fleet(1)
    backend = fleet.backends[0]
    backend.slots[0].content, backend.slots[0].record_at = long, 900.0
    backend.ram_entries = [RamEntry(long, 1.0, long.total)]
    fleet.fold_shared(0, set(), {0: (short, 30, 1000.0)}, now=5.0, wall=1000.0)
    assert backend.slots[0].content == short


def test_another_replicas_tasks_change_the_ram_cache_as_ours_do() -> None:
    """Another replica starts a task on slot 1: the server saves idle slot 0 to RAM. Its
    record then shows slot 1 holding an unrelated prompt: what slot 1 held was parked."""
    x, y, z = (
        fingerprint_chat({"messages": [{"role": "user", "content": w * 60}]}, len)
        for w in ("x ", "y ", "z ")
    )
    fleet = ready_fleet(2)
    backend = fleet.backends[0]
    for slot, content in zip(backend.slots, (x, y), strict=True):
        slot.content, slot.record_at = content, 900.0
    fleet.fold_shared(0, {1}, {}, now=5.0, wall=1000.0)
    assert [g.content for g in backend.ram_entries] == [x]  # the idle slot, saved as the task began
    fleet.fold_shared(0, set(), {1: (z, 60, 1000.5)}, now=6.0, wall=1000.6)
    assert [g.content for g in backend.ram_entries] == [x, y]
    assert backend.slots[1].content == z
    backend.ram = False  # no RAM cache: nothing is parked
    fleet.fold_shared(0, set(), {1: (x, 60, 1001.0)}, now=7.0, wall=1001.1)
    assert [g.content for g in backend.ram_entries] == [x, y]


def test_a_slot_someone_else_just_used_counts_as_just_used() -> None:
    """/slots shows a slot we did not pin processing, then idle: someone's request (another
    replica's, whose record brings the content next) left it at the probe, not when we last
    used it."""
    fleet = ready_fleet(1)
    slot = fleet.backends[0].slots[0]
    slot.last_used = 2.0
    fleet.apply_probe(0, Probe(BackendPhase.READY, (SlotProbe(0, True, 50, 3),)), now=5.0)
    assert phase_of(fleet) is SlotPhase.EXTERNAL
    fleet.apply_probe(0, Probe(BackendPhase.READY, (SlotProbe(0, False, 80, 3),)), now=9.0)
    assert phase_of(fleet) is SlotPhase.IDLE
    assert slot.last_used == 9.0


def test_a_slot_seen_busy_before_its_lease_is_freed_by_the_lease() -> None:
    """A probe saw another replica's request before this replica's view did (EXTERNAL): once
    the view shows the lease the slot is REMOTE, so the lease's end frees it, not the next
    probe seconds later (seen as 2 s stalls after a Redis outage)."""
    fleet = ready_fleet(2)
    fleet.apply_probe(0, Probe(BackendPhase.READY, (SlotProbe(0, True, 50, 3),)), now=5.0)
    assert phase_of(fleet) is SlotPhase.EXTERNAL
    fleet.fold_shared(0, {0}, {}, now=6.0, wall=1000.0)
    assert phase_of(fleet) is SlotPhase.REMOTE
    fleet.fold_shared(0, set(), {}, now=6.5, wall=1000.5)
    assert phase_of(fleet) is SlotPhase.IDLE


def test_a_slot_whose_lease_just_ended_counts_as_just_used() -> None:
    """Another replica's request left the slot when its lease ended, before the record of what
    the slot now holds arrives (a read between its lease and its record): dated to the view
    that saw the lease go, so a session's freed slot is held for its next turn here too.
    Before, it kept the last use of the record before (two replicas, chat 2 x 2 with the
    RAM cache off: waiters of the other replica took sessions' slots in that window)."""
    fleet = ready_fleet(1)
    slot = fleet.backends[0].slots[0]
    slot.last_used = 2.0
    fleet.fold_shared(0, {0}, {}, now=6.0, wall=1000.0)
    assert (slot.phase, slot.last_used) == (SlotPhase.REMOTE, 2.0)
    fleet.fold_shared(0, set(), {}, now=6.5, wall=1000.5)
    assert (slot.phase, slot.last_used) == (SlotPhase.IDLE, 6.5)
    fleet.fold_shared(0, set(), {}, now=9.0, wall=1003.0)
    assert slot.last_used == 6.5  # an idle slot's last use moves only with a newer record


def test_losing_the_store_drains_other_replicas_slots() -> None:
    """Without the store a lease cannot be seen to end: REMOTE slots drain (pinnable once a
    probe shows them idle); the backends to poll are returned, each once."""
    fleet = ready_fleet(2, 1)
    fleet.fold_shared(0, {0, 1}, {}, now=1.0, wall=1000.0)
    assert fleet.recast(SlotPhase.REMOTE, SlotPhase.DRAINING) == [0]
    assert [s.phase for s in fleet.backends[0].slots] == [SlotPhase.DRAINING] * 2
    assert fleet.backends[1].slots[0].phase is SlotPhase.IDLE
    assert fleet.is_draining(0)
    idle = (SlotProbe(0, False, 0, 4), SlotProbe(1, False, 0, 4))
    fleet.apply_probe(0, Probe(BackendPhase.READY, idle), now=2.0)
    assert fleet.backends[0].idle_slots() == fleet.backends[0].slots


@pytest.mark.parametrize("idle_saves", [True, False])
def test_idle_slot_saves_fill_a_bounded_ram_cache(idle_saves: bool) -> None:
    """The sequence of ``tests/real/test_fake_parity.py`` (room for two parked prompts; slot
    0 holds X while slot 1 runs alpha, beta, gamma): with ``--cache-idle-slots`` each task
    also saves idle slot 0's X, which leaves beta the oldest entry, the one the next save
    pushes out; without, the cache holds only what slot 1 gave up, and alpha goes first."""
    xi, alpha, beta, gamma = (
        fingerprint_chat({"messages": [{"role": "user", "content": w * 30}]}, len)
        for w in ("xixi ", "alfa ", "beta ", "gama ")  # one size
    )
    fleet = Fleet(["b0"], ram_tokens=[2 * beta.total + 1], idle_saves=[idle_saves])
    slots = tuple(SlotProbe(i, False, 0, -1) for i in range(2))
    fleet.apply_probe(0, Probe(BackendPhase.READY, slots), now=0.0)
    backend = fleet.backends[0]
    for now, (slot, content) in enumerate(((0, xi), (1, alpha), (1, beta), (1, gamma)), 1):
        fleet.claim(Placement(0, (slot,), slot), now=float(now), content=content)
        fleet.release(Placement(0, (slot,), slot), now + 0.5, clean=True, content=content)
    # beta's return saves gamma first, which pushes out the oldest entry
    parked = [g.content for g in backend.ram_entries]
    assert parked == ([beta, xi] if idle_saves else [alpha, beta])


def _fp(word: str) -> Fingerprint:
    return fingerprint_chat({"messages": [{"role": "user", "content": word * 20}]}, len)


def test_slots_are_read_only_while_there_is_a_reason() -> None:
    """Reading ``/slots`` keeps a server awake: read it after our work, while a slot is not
    idle, and until the backend is known READY; an idle backend is probed without it."""
    fleet = Fleet(["b0"])
    assert fleet.wants_slots(0)  # not probed yet
    fleet.apply_probe(0, Probe(BackendPhase.READY, ready_probe(2)), now=0.0)
    assert not fleet.wants_slots(0)
    fleet.claim(Placement(0, (0,), 0), now=1.0, content=_fp("a "))
    assert fleet.wants_slots(0)
    fleet.apply_probe(0, Probe(BackendPhase.READY, ready_probe(2)), now=1.5)  # ours still runs
    fleet.release(Placement(0, (0,), 0), now=2.0, clean=True, content=_fp("a "))
    assert fleet.wants_slots(0)  # read once more after our work
    seen = (SlotProbe(0, False, 40, 7), SlotProbe(1, True, 9, 8))
    fleet.apply_probe(0, Probe(BackendPhase.READY, seen), now=3.0)
    assert fleet.backends[0].slots[1].phase is SlotPhase.EXTERNAL
    assert fleet.wants_slots(0)  # someone else's traffic: watched until it ends
    idle = (SlotProbe(0, False, 40, 7), SlotProbe(1, False, 9, 8))
    fleet.apply_probe(0, Probe(BackendPhase.READY, idle), now=4.0)
    assert not fleet.wants_slots(0)
    unread = Probe(BackendPhase.READY, ready_probe(2), read=False)
    assert not fleet.apply_probe(0, unread, now=5.0)  # not read: no restart (task ids unseen)
    assert fleet.backends[0].slots[0].content == _fp("a ")


def test_a_sleeping_backend_forgets_every_slot_and_its_ram_cache_once() -> None:
    fleet = Fleet(["b0"])
    fleet.apply_probe(0, Probe(BackendPhase.READY, ready_probe(2)), now=0.0)
    for slot, word in ((0, "a "), (1, "b "), (0, "c ")):  # a is parked in RAM
        fleet.claim(Placement(0, (slot,), slot), now=1.0, content=_fp(word))
        fleet.release(Placement(0, (slot,), slot), now=2.0, clean=True, content=_fp(word))
    backend = fleet.backends[0]
    assert backend.ram_entries
    assert backend.slots[0].content is not None
    asleep = Probe(BackendPhase.READY, ready_probe(2), read=False, sleeping=True)
    assert fleet.apply_probe(0, asleep, now=3.0)
    assert (backend.ram_entries, [s.content for s in backend.slots]) == ([], [None, None])
    assert not fleet.apply_probe(0, asleep, now=4.0)  # still asleep: nothing new lost
    awake = Probe(BackendPhase.READY, ready_probe(2), read=False)
    assert not fleet.apply_probe(0, awake, now=5.0)
    assert not backend.asleep


@pytest.mark.parametrize("unified", [True, False])
def test_with_unified_kv_an_idle_slot_saved_as_a_task_starts_is_cleared(unified: bool) -> None:
    """llama-server with ``--kv-unified`` and ``--cache-idle-slots`` saves every idle slot to
    the RAM cache as a task starts, then clears it (its cells are room for the others)."""
    fleet = Fleet(["b0"], unified=[unified])
    fleet.apply_probe(0, Probe(BackendPhase.READY, ready_probe(2)), now=0.0)
    fleet.claim(Placement(0, (0,), 0), now=1.0, content=_fp("a "))
    fleet.release(Placement(0, (0,), 0), now=2.0, clean=True, content=_fp("a "), n_tokens=40)
    fleet.claim(Placement(0, (1,), 1), now=3.0, content=_fp("b "))
    slot0 = fleet.backends[0].slots[0]
    assert [g.content for g in fleet.backends[0].ram_entries] == [_fp("a ")]
    assert (slot0.content, slot0.n_tokens) == ((None, 0) if unified else (_fp("a "), 40))


def _chain(*segments: int, anchor: int = 2) -> Fingerprint:
    """A chat chain of 100-token segments (system prompt, then the session's messages)."""
    hashes = tuple(hash(segments[: i + 1]) for i in range(len(segments)))
    return Fingerprint(hashes, tuple(100 * (i + 1) for i in range(len(segments))), anchor)


def test_a_primed_claim_whose_primer_failed_is_modelled_as_unprimed() -> None:
    """A primed claim parks the slot's content and takes the session's entry out of the RAM
    model; when the primer fails, neither happened: the model is as before the claim."""
    fleet = ready_fleet(2)
    backend = fleet.backends[0]
    other, session = _chain(1, 2, 3), _chain(1, 5, 6)
    backend.slots[0].content = other
    entry = RamEntry(session, 1.0)
    backend.ram_entries = [entry]
    placement = Placement(0, (0,), 0, entry, primed=True)
    fleet.claim(placement, now=2.0, content=_chain(1, 5, 6, 7))
    assert [e.content for e in backend.ram_entries] == [other]
    fleet.unprimed(placement)
    assert backend.ram_entries == [entry]
    fleet.release(placement, now=3.0, clean=True, content=_chain(1, 5, 6, 7, 8))
    assert backend.ram_entries == [entry]
    # another task claimed and released slot 1 while the primer was out: only the claim's own
    # changes are taken back
    backend.slots[0].content, backend.ram_entries = other, [entry]
    fleet.claim(placement, now=4.0, content=_chain(1, 5, 6, 7))
    fleet.claim(Placement(0, (1,), 1), now=4.0, content=_chain(9))
    fleet.release(Placement(0, (1,), 1), now=4.5, clean=True, content=_chain(9, 10))
    fleet.unprimed(placement)
    assert [e.content for e in backend.ram_entries] == [session]


def test_another_replicas_primed_request_is_folded_in_as_a_load() -> None:
    """Another replica primed slot 0, holding another session under the same system prompt,
    and its request loaded its session from RAM: the slot's old content is parked and the
    loaded entry gone, as for our own primed claim."""
    fleet = ready_fleet(2)
    backend = fleet.backends[0]
    # a two-segment system prompt: the request keeps two thirds of the other session
    other, session = _chain(1, 2, 3, anchor=3), _chain(1, 2, 5, 6, anchor=3)
    backend.slots[0].content, backend.slots[0].record_at = other, 900.0
    backend.ram_entries = [RamEntry(session, 1.0)]
    after = _chain(1, 2, 5, 6, 7, anchor=3)
    fleet.fold_shared(0, set(), {0: (after, 500, 1000.0)}, now=5.0, wall=1000.0)
    assert [e.content for e in backend.ram_entries] == [other]
    # a request continuing the slot's own content took nothing from RAM
    onward = _chain(1, 2, 5, 6, 7, 8, anchor=3)
    fleet.fold_shared(0, set(), {0: (onward, 600, 1001.0)}, now=6.0, wall=1001.0)
    assert [e.content for e in backend.ram_entries] == [other]
    # where the replicas prime no slot (cache isolation), such a record is no load
    fleet = ready_fleet(2)
    fleet.primes = False
    backend = fleet.backends[0]
    backend.slots[0].content, backend.slots[0].record_at = other, 900.0
    backend.ram_entries = [RamEntry(session, 1.0)]
    fleet.fold_shared(0, set(), {0: (after, 500, 1000.0)}, now=5.0, wall=1000.0)
    assert [e.content for e in backend.ram_entries] == [session]


@pytest.mark.parametrize(("kv", "kept"), [(300, 3), (500, 3), (150, 1), (0, 0)])
def test_an_aborted_prompt_stays_in_its_slot_as_far_as_the_drain_reads(kv: int, kept: int) -> None:
    """llama-server keeps the KV of a task cut short: the whole prompt once it is prefilled
    (with part of a reply: a longer KV), a prefix of it when cut during the prefill, nothing
    of it when cut before; whose KV it is, under cache isolation, is not known."""
    fleet = ready_fleet(1)
    slot, placement = fleet.backends[0].slots[0], Placement(0, (0,), 0)
    prompt = Fingerprint((1, 2, 3), (100, 200, 300))
    fleet.claim(placement, now=1.0, content=prompt)
    slot.owner = "tenant b"  # (cache isolation: as the request's claim records it)
    fleet.release(placement, now=2.0, clean=False)
    assert phase_of(fleet) is SlotPhase.DRAINING
    assert slot.owner is None  # cut before it started, the task left another tenant's KV
    fleet.apply_probe(0, Probe(BackendPhase.READY, (SlotProbe(0, False, kv, 1),)), now=3.0)
    assert phase_of(fleet) is SlotPhase.IDLE
    held = slot.content.hashes if slot.content is not None else ()
    assert held == prompt.hashes[:kept]


def test_a_lease_that_may_have_expired_leaves_the_slot_busy_until_seen_idle() -> None:
    """A lease that ends a TTL or more after this replica first saw it may have expired: its
    replica died, or gave up a request the server may still run. The slot is not pinned
    until a newer record (that request ended cleanly) or a ``/slots`` read shows it idle; a
    lease that ends sooner was given back."""
    content = fingerprint_chat({"messages": [{"role": "user", "content": "a " * 40}]}, len)
    fleet = ready_fleet(3)
    fleet.fold_shared(0, {0, 1, 2}, {}, now=6.0, wall=1000.0, lease_ttl=30.0)
    fleet.fold_shared(0, {1, 2}, {}, now=20.0, wall=1014.0, lease_ttl=30.0)
    assert phase_of(fleet, slot=0) is SlotPhase.IDLE  # given back
    fleet.fold_shared(0, set(), {}, now=36.0, wall=1030.0, lease_ttl=30.0)
    assert [phase_of(fleet, slot=s) for s in (1, 2)] == [SlotPhase.EXTERNAL] * 2
    assert place(fleet.backends, Need(slot=1)) is NoPlacement.BUSY
    fleet.fold_shared(0, set(), {1: (content, 40, 1030.5)}, now=37.0, wall=1031.0, lease_ttl=30.0)
    assert phase_of(fleet, slot=1) is SlotPhase.IDLE
    seen = tuple(SlotProbe(i, i == 2, 40, 9) for i in range(3))
    fleet.apply_probe(0, Probe(BackendPhase.READY, seen), now=38.0)
    assert phase_of(fleet, slot=2) is SlotPhase.EXTERNAL  # still running there
    seen = tuple(SlotProbe(i, False, 40, 9) for i in range(3))
    fleet.apply_probe(0, Probe(BackendPhase.READY, seen), now=39.0)
    assert phase_of(fleet, slot=2) is SlotPhase.IDLE


def test_a_lapsed_lease_on_a_backend_whose_slots_cannot_be_read_is_taken_for_idle() -> None:
    """No ``/slots`` read will show such a slot idle (``--no-slots``, or its key not given to
    the proxy): a probe that read none takes it for idle, what it holds unknown; not one
    whose lease ended after the probe was sent."""
    fleet = ready_fleet(2)
    fleet.backends[0].slots[0].content = Fingerprint((1,), (100,))
    fleet.fold_shared(0, {0, 1}, {}, now=6.0, wall=1000.0, lease_ttl=30.0)
    fleet.fold_shared(0, {1}, {}, now=40.0, wall=1034.0, lease_ttl=30.0)
    fleet.fold_shared(0, set(), {}, now=42.0, wall=1036.0, lease_ttl=30.0)
    assert [phase_of(fleet, slot=s) for s in (0, 1)] == [SlotPhase.EXTERNAL] * 2
    fleet.apply_probe(0, Probe(BackendPhase.READY, ready_probe(2), read=False), now=41.0)
    assert [phase_of(fleet, slot=s) for s in (0, 1)] == [SlotPhase.IDLE, SlotPhase.EXTERNAL]
    assert fleet.backends[0].slots[0].content is None
