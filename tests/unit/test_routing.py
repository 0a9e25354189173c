from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.prompt.fingerprint import PART_BYTES, Fingerprint, Part
from proxy.core.routing import options, waiting
from proxy.core.routing.decision import Decision, Reason, RoutingParams, predicted_reuse, route
from proxy.core.routing.scoring import (
    RamView,
    RamViews,
    candidate,
    kin_bound,
    kin_ceiling,
    kin_loads,
    kin_reach,
    ram_reuse,
    ram_view,
    stranger_ceiling,
    stranger_most,
)
from proxy.core.server.fleet import (
    BackendPhase,
    BackendState,
    Fleet,
    NoPlacement,
    Placement,
    Probe,
    SlotPhase,
    SlotProbe,
    SlotState,
)
from proxy.core.server.ram_cache import RamEntry

PARAMS = RoutingParams(min_prefix_tokens=16, wait_min_tokens=100)


def fp(*segments: int, size: int = 100) -> Fingerprint:
    """A chain of the given segment ids, as real fingerprints chain them: hash ``i`` covers
    segments ``0..i`` (distinct ids = distinct prefixes)."""
    hashes = tuple(hash(segments[: i + 1]) for i in range(len(segments)))
    return Fingerprint(hashes, tuple(size * (i + 1) for i in range(len(segments))))


def fleet(*slots: int, exact: tuple[bool, ...] = ()) -> Fleet:
    f = Fleet([f"b{i}" for i in range(len(slots))], exact)
    for index, count in enumerate(slots):
        probe = Probe(BackendPhase.READY, tuple(SlotProbe(i, False, 0, -1) for i in range(count)))
        f.apply_probe(index, probe, now=0.0)
    return f


def hold(f: Fleet, backend: int, slot: int, content: Fingerprint, at: float = 100.0) -> None:
    s = f.backends[backend].slots[slot]
    s.content, s.last_used = content, at


def decided(result: Decision | NoPlacement) -> Decision:
    assert isinstance(result, Decision)
    return result


def test_session_goes_to_the_slot_holding_its_prefix() -> None:
    f = fleet(2, 2)
    hold(f, 1, 1, fp(1, 2, 3))
    hold(f, 0, 0, fp(1, 9))
    d = decided(route(fp(1, 2, 3, 4), f.backends, PARAMS, now=100.0))
    assert (d.reason, d.placement) == (Reason.PREFIX, Placement(1, (1,), 1))
    assert d.predicted == 300


def test_one_off_request_does_not_evict_a_warm_long_session() -> None:
    f = fleet(2)
    hold(f, 0, 0, fp(1, 2, 3, 4, 5, 6, 7, 8))  # long warm session sharing only segment 1
    d = decided(route(fp(1, 50), f.backends, PARAMS, now=100.0))
    assert d.placement == Placement(0, (1,), 1)  # the empty slot
    assert d.reason is Reason.COLD


def test_cold_request_prefers_an_empty_slot_within_load_tolerance() -> None:
    f = fleet(2, 2)
    f.claim(Placement(0, (0,), 0), now=1.0)
    hold(f, 1, 0, fp(7, 8, 9), at=99.0)
    hold(f, 1, 1, fp(5), at=10.0)
    d = decided(route(fp(42), f.backends, PARAMS, now=100.0))
    assert d.placement == Placement(0, (1,), 1)


def test_a_tie_goes_to_a_backend_this_replica_schedules() -> None:
    """Equal choices on backends another replica schedules (``remote``) lose the tie: no
    forwarding hop. A better score or a lighter load still wins wherever it is."""
    f = fleet(2, 2, 2)
    cold = decided(route(fp(42), f.backends, PARAMS, now=100.0, remote=frozenset({0})))
    assert cold.placement == Placement(1, (0,), 0)
    assert decided(route(fp(42), f.backends, PARAMS, now=100.0)).placement == Placement(0, (0,), 0)
    hold(f, 0, 1, fp(1, 2, 3))
    prefix = decided(route(fp(1, 2, 3, 4), f.backends, PARAMS, now=100.0, remote=frozenset({0})))
    assert prefix.placement == Placement(0, (1,), 1)  # the prefix is only there
    f.claim(Placement(1, (0,), 0), now=1.0)
    lighter = decided(route(fp(42), f.backends, PARAMS, now=100.0, remote=frozenset({0, 2})))
    assert lighter.placement == Placement(0, (0,), 0)  # load before the tie


def test_cold_request_evicts_the_least_valuable_slot() -> None:
    f = fleet(2)
    hold(f, 0, 0, fp(7, 8, 9), at=99.0)
    hold(f, 0, 1, fp(5), at=10.0)
    d = decided(route(fp(42), f.backends, PARAMS, now=100.0))
    assert d.placement == Placement(0, (1,), 1)


def test_a_cold_request_weighs_a_raw_prompt_by_its_kv_reply_included() -> None:
    """A raw prompt's slot holds its reply as well (``sealed``, ``n_tokens`` real): evicting
    it for a request that reuses none of it loses the whole KV, as a chat content's estimate
    (which holds its reply) already counts. A 20-token prompt with a 60-token reply is worth
    more than a 35-token prompt with a short one (taubench 2 x 3: a session's 16-token
    question, evicted for a stranger, was extended by its next turn)."""
    f = fleet(2)
    hold(f, 0, 0, replace(fp(1, size=20), sealed=True))
    f.backends[0].slots[0].n_tokens = 80
    hold(f, 0, 1, replace(fp(2, size=35), sealed=True))
    f.backends[0].slots[1].n_tokens = 38
    d = decided(route(fp(42), f.backends, PARAMS, now=100.0))
    assert (d.reason, d.placement) == (Reason.COLD, Placement(0, (1,), 1))
    turn = decided(route(Fingerprint(fp(1, 3).hashes, (20, 49)), f.backends, PARAMS, now=100.0))
    assert turn.placement == Placement(0, (0,), 0)  # its continuation does not pay for it


def test_waits_for_a_busy_slot_worth_it_and_not_after_the_bound() -> None:
    f = fleet(2)
    hold(f, 0, 0, fp(1, 2, 3))
    f.claim(Placement(0, (0,), 0), now=100.0, content=fp(1, 2, 3))
    d = decided(route(fp(1, 2, 3, 4), f.backends, PARAMS, now=100.0))
    assert (d.reason, d.placement, d.wait_for) == (Reason.WAIT, None, (0, 0))
    later = decided(route(fp(1, 2, 3, 4), f.backends, PARAMS, now=101.0, allow_wait=False))
    assert later.placement == Placement(0, (1,), 1)


def test_most_of_a_short_prompt_is_worth_waiting_for() -> None:
    f = fleet(2)  # wait_min_tokens 100, wait_min_fraction 0.5
    hold(f, 0, 0, fp(1, 2, size=30))
    f.claim(Placement(0, (0,), 0), now=100.0, content=fp(1, 2, size=30))
    short = decided(route(fp(1, 2, 3, size=30), f.backends, PARAMS, now=100.0))
    assert (short.reason, short.wait_for, short.predicted) == (Reason.WAIT, (0, 0), 60)
    longer = fp(1, 2, 3, 4, 5, 6, 7, 8, size=30)
    alone = decided(route(longer, f.backends, PARAMS, now=100.0))
    assert (alone.reason, alone.placement) == (Reason.COLD, Placement(0, (1,), 1))


def test_a_newcomer_starts_on_an_empty_slot_rather_than_wait_for_one_it_would_not_take() -> None:
    """A burst of new sessions sharing a long system prompt (segment 1): while the first
    runs, the others start at once on empty slots instead of waiting for its slot, which once
    free holds another conversation they would not take; its own next turn still waits."""
    f = fleet(4)
    first = Fingerprint(fp(1, 2).hashes, (2000, 2040), anchor=2)
    f.claim(Placement(0, (0,), 0), now=100.0, content=first)
    newcomer = decided(
        route(Fingerprint(fp(1, 3).hashes, (2000, 2040), 2), f.backends, PARAMS, now=100.0)
    )
    assert (newcomer.reason, newcomer.placement) == (Reason.COLD, Placement(0, (1,), 1))
    turn = Fingerprint(fp(1, 2, 4).hashes, (2000, 2040, 2060), anchor=2)
    again = decided(route(turn, f.backends, PARAMS, now=100.0))
    assert (again.reason, again.wait_for) == (Reason.WAIT, (0, 0))
    for s in (1, 2, 3):  # no empty slot left: the newcomer waits, as it did before
        hold(f, 0, s, Fingerprint(fp(10 + s, 20).hashes, (2000, 2040), anchor=2))
    late = decided(
        route(Fingerprint(fp(1, 3).hashes, (2000, 2040), 2), f.backends, PARAMS, now=100.0)
    )
    assert (late.reason, late.wait_for) == (Reason.WAIT, (0, 0))


def test_a_cold_choice_that_keeps_the_prefix_is_reported_as_prefix() -> None:
    """Every idle slot holds another conversation with the same system prompt (segment 1):
    none scores (taking one destroys more than it reuses), the least bad is taken, and it
    serves the system prompt: the route says so."""
    f = fleet(2)
    for s in (0, 1):
        hold(f, 0, s, Fingerprint(fp(1, 10 + s, 20 + s).hashes, (2000, 2040, 2400), anchor=2))
    d = decided(route(Fingerprint(fp(1, 3).hashes, (2000, 2040), 2), f.backends, PARAMS, now=100.0))
    assert (d.reason, d.predicted, d.placement is not None) == (Reason.PREFIX, 2000, True)
    f.backends[0].slots[1].content = None  # an empty slot: a real cold start
    d = decided(route(Fingerprint(fp(1, 3).hashes, (2000, 2040), 2), f.backends, PARAMS, now=100.0))
    assert (d.reason, d.predicted) == (Reason.COLD, 0)


def test_a_saturated_fleet_waits_for_any_real_saving() -> None:
    f = fleet(4, 4, 4, 4)
    prompt = fp(*range(1, 9), size=50)  # 400 tokens; a busy slot holds its first 50
    for b, s in [(b, s) for b in range(4) for s in range(4)][:-2]:
        content = fp(1, 99, size=50) if (b, s) == (0, 0) else fp(1000 + 4 * b + s)
        f.claim(Placement(b, (s,), s), now=100.0, content=content)
    roomy = decided(route(prompt, f.backends, PARAMS, now=100.0))  # two idle slots of 16
    assert (roomy.reason, roomy.placement) == (Reason.COLD, Placement(3, (2,), 2))
    f.claim(Placement(3, (2,), 2), now=100.0, content=fp(2000))  # one idle slot of 16 left
    saturated = decided(route(prompt, f.backends, PARAMS, now=100.0))
    assert (saturated.reason, saturated.wait_for) == (Reason.WAIT, (0, 0))
    small = fleet(1, 1)  # a small fleet with an idle slot is never saturated
    small.claim(Placement(0, (0,), 0), now=100.0, content=fp(1, 99, size=50))
    assert decided(route(prompt, small.backends, PARAMS, now=100.0)).reason is Reason.COLD


def test_queued_requests_make_a_full_backends_ram_copy_worth_any_real_saving() -> None:
    f = fleet(1, 1)  # wait_min_tokens 100: a 40-token saving is not worth a wait alone
    hold(f, 0, 0, fp(1, size=40))
    f.claim(Placement(0, (0,), 0), now=100.0, content=fp(9))  # parks fp(1) in b0's RAM
    prompt = fp(1, 2, 3, 4, 5, 6, 7, 8, size=40)
    alone = decided(route(prompt, f.backends, PARAMS, now=100.0, queued=1))
    assert (alone.reason, alone.placement) == (Reason.COLD, Placement(1, (0,), 0))
    pressed = decided(route(prompt, f.backends, PARAMS, now=100.0, queued=2))
    assert (pressed.reason, pressed.wait_for, pressed.predicted) == (Reason.WAIT, (0, -1), 40)
    # half the usual bar (half of min(wait_min_tokens, half the prompt)) is worth a wait
    # for a full backend: it frees *some* slot sooner than one given slot finishes
    short = fp(1, 2, 3, size=40)  # 120 tokens: the bar is 60, half of it 30
    ram = decided(route(short, f.backends, PARAMS, now=100.0, queued=1))
    assert (ram.reason, ram.wait_for, ram.predicted) == (Reason.WAIT, (0, -1), 40)
    hold(f, 1, 0, fp(1, size=40))  # the same saving in a busy slot: the usual bar
    f.claim(Placement(1, (0,), 0), now=100.0, content=fp(1, size=40))
    f.release(Placement(0, (0,), 0), now=100.0, clean=True, content=fp(9))
    f.backends[0].ram_entries = []  # b0 is idle again; no RAM copy anywhere
    busy = decided(route(short, f.backends, PARAMS, now=100.0, queued=1))
    assert (busy.reason, busy.placement) == (Reason.COLD, Placement(0, (0,), 0))
    busy = decided(route(prompt, f.backends, PARAMS, now=100.0, queued=5))
    assert (busy.reason, busy.placement) == (Reason.COLD, Placement(0, (0,), 0))


def test_a_short_prompt_repeated_whole_is_a_hit_not_a_stranger() -> None:
    """Under ``min_prefix_tokens`` (16), a 14-token prompt cached whole (13 reusable) is
    placed where it is, past the cold path's load limit, and under queue pressure waits for
    the full backend whose RAM cache holds it (an agent retrying one short request)."""
    prompt = fp(1, size=14)
    f = fleet(4, 1)
    for s in range(3):
        f.claim(Placement(0, (s,), s), now=100.0, content=fp(50 + s))
    hold(f, 0, 3, prompt)
    d = decided(route(prompt, f.backends, PARAMS, now=100.0))
    assert (d.reason, d.placement, d.predicted) == (Reason.PREFIX, Placement(0, (3,), 3), 13)
    stranger = decided(route(fp(2, size=14), f.backends, PARAMS, now=100.0))
    assert (stranger.reason, stranger.placement) == (Reason.COLD, Placement(1, (0,), 0))
    g = fleet(1, 1)
    hold(g, 0, 0, prompt)
    g.claim(Placement(0, (0,), 0), now=100.0, content=fp(9))  # parks the prompt in b0's RAM
    pressed = decided(route(prompt, g.backends, PARAMS, now=100.0, queued=2))
    assert (pressed.reason, pressed.wait_for, pressed.predicted) == (Reason.WAIT, (0, -1), 13)
    tiny = fp(1, size=3)  # too short to count: re-prefilling it costs nothing
    assert decided(route(tiny, g.backends, PARAMS, now=100.0, queued=2)).reason is Reason.COLD


def test_session_evicted_into_ram_is_found_there_while_the_evicting_request_runs() -> None:
    f = fleet(1, 1)  # RAM prompt cache on (the default)
    hold(f, 0, 0, fp(1, 2, 3, 4))
    f.claim(Placement(0, (0,), 0), now=100.0, content=fp(9))  # another session takes it
    d = decided(route(fp(1, 2, 3, 4, 5), f.backends, PARAMS, now=100.0))
    assert (d.reason, d.wait_for, d.predicted) == (Reason.WAIT, (0, -1), 400)
    f.release(Placement(0, (0,), 0), now=101.0, clean=True, content=fp(9, 10))
    back = decided(route(fp(1, 2, 3, 4, 5), f.backends, PARAMS, now=101.0))
    assert back.placement is not None
    assert back.placement.from_ram is not None
    assert (back.placement.pin, back.predicted) == (0, 400)
    assert back.placement.from_ram.content == fp(1, 2, 3, 4)  # the server loads the parked copy
    f.claim(back.placement, now=101.0, content=fp(1, 2, 3, 4, 5))
    assert [p.content for p in f.backends[0].ram_entries] == [fp(9, 10)]  # moved out, slot parked
    assert not f.backends[1].ram_entries


def test_header_only_request_does_not_destroy_a_session_parked_in_ram() -> None:
    f = fleet(2)

    def chat(*segments: int) -> Fingerprint:
        return replace(fp(*segments), anchor=2)  # system prompt, then the first user message

    hold(f, 0, 0, chat(50, 51, 52, 53), at=90.0)  # an unrelated conversation
    parked = RamEntry(chat(1, 2, 3, 4), 99.0)  # a session sharing the system prompt 1
    f.backends[0].ram_entries = [parked]
    # Pinned to slot 0 (keeps nothing of it), the server would load the parked session for
    # its 100-token header and overwrite the rest: the request takes the empty slot instead.
    d = decided(route(chat(1, 30, 31, 32), f.backends, PARAMS, now=100.0))
    assert d.placement == Placement(0, (1,), 1)
    assert f.backends[0].ram_entries == [parked]
    # The session itself is served from RAM through the slot that keeps nothing of it.
    back = decided(route(chat(1, 2, 3, 4, 5), f.backends, PARAMS, now=100.0))
    assert back.placement == Placement(0, (0,), 0, parked)
    assert back.predicted == 400


def test_request_waits_rather_than_make_the_server_destroy_a_parked_session() -> None:
    f = fleet(3)

    def chat(*segments: int) -> Fingerprint:
        return replace(fp(*segments), anchor=2)

    hold(f, 0, 0, chat(50, 51, 52, 53), at=90.0)  # the one idle slot: an unrelated conversation
    for slot in (1, 2):
        f.claim(Placement(0, (slot,), slot), now=100.0, content=chat(60 + slot, 70))
    parked = RamEntry(chat(1, 2, 3, 4), 99.0)  # a session sharing the 100-token system prompt
    f.backends[0].ram_entries = [parked]
    # Pinned to slot 0, the server would load the parked session for the header (a quarter of
    # it) and overwrite 300 of its tokens, to save 100: the request waits for another slot.
    request = chat(1, 30, 31, 32, 33, 34, 35, 36)
    d = decided(route(request, f.backends, PARAMS, now=100.0))
    assert (d.reason, d.placement, d.wait_for) == (Reason.WAIT, None, (0, 1))
    late = decided(route(request, f.backends, PARAMS, now=100.0, allow_wait=False))
    assert late.placement == Placement(0, (0,), 0, parked)  # past the bound it goes ahead
    # the session comes back and takes its copy into slot 1; then the request goes ahead
    f.release(Placement(0, (1,), 1), now=101.0, clean=True, content=chat(1, 2, 3, 4, 5))
    f.backends[0].ram_entries = []
    after = decided(route(request, f.backends, PARAMS, now=101.0))
    assert after.placement is not None
    assert after.placement.from_ram is None


def test_session_stays_in_its_slot_rather_than_loading_its_ram_copy_elsewhere() -> None:
    f = fleet(2)
    hold(f, 0, 0, fp(50, 51, 52), at=90.0)  # older content of another prompt
    hold(f, 0, 1, fp(1, 2, 3, 4, 5))
    f.backends[0].ram_entries = [RamEntry(fp(1, 2, 3, 4, 5), 100.0)]  # idle save: a copy of slot 1
    # Loading the copy into slot 0 would serve as much, but parks slot 0's content for
    # nothing (and the copy may not be in RAM yet: idle slots are saved after the load).
    d = decided(route(fp(1, 2, 3, 4, 5, 6), f.backends, PARAMS, now=100.0))
    assert d.placement == Placement(0, (1,), 1)


def test_ram_budget_evicts_the_oldest_parked_session_from_the_model() -> None:
    f = Fleet(["b0"], ram_tokens=[300])  # the backend's RAM cache holds 300 tokens
    f.apply_probe(0, Probe(BackendPhase.READY, (SlotProbe(0, False, 0, -1),)), now=0.0)
    hold(f, 0, 0, fp(1, 2))
    for content in (fp(3, 4), fp(5)):
        f.claim(Placement(0, (0,), 0), now=100.0, content=content)
        f.release(Placement(0, (0,), 0), now=101.0, clean=True, content=content)
    assert [p.content for p in f.backends[0].ram_entries] == [fp(3, 4)]  # fp(1, 2) made room
    assert ram_reuse(fp(1, 2, 9), f.backends[0]) == 0


def test_a_pinned_slot_is_parked_only_when_its_prompt_keeps_less_than_half() -> None:
    f = fleet(1)
    hold(f, 0, 0, fp(1, 2, 3, 4))
    # the prompt keeps 3 of 4 segments (f_keep >= 0.5): the server's RAM hook does not run,
    # so nothing is saved and the tail the prompt does not share is simply overwritten
    f.claim(Placement(0, (0,), 0), now=101.0, content=fp(1, 2, 3, 9))
    f.release(Placement(0, (0,), 0), now=102.0, clean=True, content=fp(1, 2, 3, 9))
    assert f.backends[0].ram_entries == []
    f.claim(Placement(0, (0,), 0), now=103.0, content=fp(1, 7))  # keeps 1 of 4: parked
    assert [p.content for p in f.backends[0].ram_entries] == [fp(1, 2, 3, 9)]


def test_ram_budget_counts_the_servers_real_lengths() -> None:
    f = Fleet(["b0"], ram_tokens=[1000])
    f.apply_probe(0, Probe(BackendPhase.READY, (SlotProbe(0, False, 0, -1),)), now=0.0)
    hold(f, 0, 0, fp(1, 2))  # 200 tokens estimated
    f.backends[0].slots[0].n_tokens = 700  # the server's real length (code: ~3x estimates)
    for content, real in ((fp(3, 4), 600), (fp(5), 500)):
        f.claim(Placement(0, (0,), 0), now=100.0, content=content)
        f.release(Placement(0, (0,), 0), now=101.0, clean=True, content=content, n_tokens=real)
    # 700 + 600 real tokens do not fit 1000 (their 400 estimated tokens would): the oldest went
    assert [(p.content, p.size) for p in f.backends[0].ram_entries] == [(fp(3, 4), 600)]


def test_a_saving_stays_on_its_loaded_backend() -> None:
    """A request sharing most of its prompt with a slot of a loaded backend goes there, not
    to an idle backend: load only breaks ties between equal scores (there is no load gate)."""
    f = fleet(5, 5)
    for slot in range(4):
        f.claim(Placement(0, (slot,), slot), now=1.0)
    hold(f, 0, 4, fp(1, 2, 9, size=10))  # its own history, rewritten after segment 2
    request = fp(1, 2, 3, size=10)  # shares 20 of 30 tokens
    d = decided(route(request, f.backends, PARAMS, now=100.0, allow_wait=False))
    assert (d.reason, d.placement) == (Reason.PREFIX, Placement(0, (4,), 4))


def test_a_session_continuing_in_its_slot_stays_on_its_loaded_backend() -> None:
    f = fleet(5, 5)
    for slot in range(4):
        f.claim(Placement(0, (slot,), slot), now=1.0)
    hold(f, 0, 4, fp(1, 2, 3))  # this session's previous turn
    d = decided(route(fp(1, 2, 3, 4), f.backends, PARAMS, now=100.0, allow_wait=False))
    assert (d.reason, d.placement) == (Reason.PREFIX, Placement(0, (4,), 4))


def test_exact_backends_only_count_a_strict_extension() -> None:
    f = fleet(1, exact=(True,))
    slot = f.backends[0].slots[0]
    slot.content = fp(1, 2, 3)
    assert predicted_reuse(fp(1, 2, 3, 4), slot, exact=True) == 300
    assert predicted_reuse(fp(1, 2, 9), slot, exact=True) == 0  # diverges inside the cache
    assert predicted_reuse(fp(1, 2, 3), slot, exact=True) == 0  # exact repeat
    assert predicted_reuse(fp(1, 2, 3), slot, exact=False) == 299  # one token re-evaluated


def test_cache_key_decides_a_tie_reuses_only_a_hit_and_skips_a_busy_slot() -> None:
    """Two slots hold the same content: the key picks its own. A prompt its slot serves less
    than a hit of (nothing, or under ``min_prefix_tokens``) routes by prefix ("unsafe")."""
    params = RoutingParams(min_prefix_tokens=16)
    f = fleet(2)
    hold(f, 0, 1, fp(1, 2, 3))
    hold(f, 0, 0, fp(1, 2, 3))
    same = decided(route(fp(1, 2, 3, 4), f.backends, params, now=100.0, affinity=(0, 1)))
    assert (same.reason, same.key_outcome, same.placement) == (
        Reason.AFFINITY,
        "reuse",
        Placement(0, (1,), 1),
    )
    unrelated = decided(route(fp(77, 78), f.backends, params, now=100.0, affinity=(0, 1)))
    assert unrelated.key_outcome == "unsafe"
    assert unrelated.reason is not Reason.AFFINITY
    high = replace(params, min_prefix_tokens=301)  # the 300 tokens it serves are not a hit
    under = decided(route(fp(1, 2, 3, 4), f.backends, high, now=100.0, affinity=(0, 1)))
    assert (under.key_outcome, under.reason) == ("unsafe", Reason.COLD)
    f.claim(Placement(0, (1,), 1), now=100.0)
    busy = decided(
        route(fp(1, 2, 3, 4), f.backends, params, now=100.0, affinity=(0, 1), allow_wait=False)
    )
    assert busy.key_outcome == "busy"
    assert busy.placement == Placement(0, (0,), 0)


def test_a_keyed_slot_is_the_best_idle_choice_and_a_busy_slot_saving_more_is_waited_for() -> None:
    """The key's slot serves the system prompt (100 tokens); the session's history (300)
    is in a busy slot. The key names the best idle choice, not the decision: the saving of
    the busy slot is worth the wait, as it is without a key."""
    f = fleet(2)
    f.claim(Placement(0, (0,), 0), now=100.0, content=fp(1, 2, 3))
    hold(f, 0, 1, fp(1))
    request = fp(1, 2, 3, 4)
    keyed = decided(route(request, f.backends, PARAMS, now=100.0, affinity=(0, 1)))
    plain = decided(route(request, f.backends, PARAMS, now=100.0))
    assert (keyed.reason, keyed.wait_for) == (plain.reason, plain.wait_for) == (Reason.WAIT, (0, 0))
    later = decided(
        route(request, f.backends, PARAMS, now=101.0, affinity=(0, 1), allow_wait=False)
    )
    assert (later.reason, later.key_outcome, later.placement) == (
        Reason.AFFINITY,
        "reuse",
        Placement(0, (1,), 1),
    )


def test_cache_key_yields_to_a_slot_that_holds_more_of_the_prompt() -> None:
    """An agent session alternating two prompt threads (the agent's and its user simulator's,
    as in taubench) holds one slot per thread; its key maps to the slot it used last. A turn
    of the other thread overlaps that slot enough to be safe, but pinning it there would
    overwrite the first thread while the second one's own slot sits idle (replay, taubench
    8 sessions with session keys: 0.853 before, 0.859 as without keys)."""
    params = RoutingParams(min_prefix_tokens=16)
    f = fleet(2)
    hold(f, 0, 0, fp(1, 2, 3, 4))  # the agent's thread, where the key points
    hold(f, 0, 1, fp(1, 5))  # the user simulator's thread
    d = decided(route(fp(1, 5, 6), f.backends, params, now=100.0, affinity=(0, 0)))
    assert (d.reason, d.key_outcome, d.placement) == (
        Reason.PREFIX,
        "outmatched",
        Placement(0, (1,), 1),
    )


def test_nothing_ready() -> None:
    f = Fleet(["a"])
    assert route(fp(1), f.backends, PARAMS, now=0.0) is NoPlacement.LOADING


@st.composite
def scenes(draw: st.DrawFn) -> tuple[Fleet, Fingerprint, tuple[int, int] | None]:
    counts = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    f = fleet(*counts, exact=tuple(draw(st.booleans()) for _ in counts))
    chains = st.lists(st.integers(1, 4), min_size=1, max_size=5).map(lambda c: fp(*c))
    for backend in f.backends:
        if draw(st.integers(0, 4)) == 0:
            backend.phase = draw(st.sampled_from(list(BackendPhase)))
        for slot in backend.slots:
            slot.phase = draw(st.sampled_from(list(SlotPhase)))
            slot.content = draw(st.none() | chains)
            slot.last_used = draw(st.floats(0, 100))
    hint = draw(st.none() | st.tuples(st.integers(0, 3), st.integers(0, 3)))
    return f, draw(chains), hint


@settings(max_examples=300)
@given(scenes(), st.booleans(), st.sampled_from([0.0, 0.5, 50.0]), st.booleans())
def test_property_never_a_busy_slot(
    scene: tuple[Fleet, Fingerprint, tuple[int, int] | None],
    allow_wait: bool,
    hold: float,
    ram: bool,
) -> None:
    f, request, hint = scene
    for backend in f.backends:
        backend.ram = ram  # without it, slots a session just left are held
    result = route(
        request, f.backends, PARAMS, now=100.0, affinity=hint, allow_wait=allow_wait, hold=hold
    )
    if isinstance(result, Decision) and result.placement is not None:
        backend = f.backends[result.placement.backend]
        assert backend.phase is BackendPhase.READY
        assert backend.slots[result.placement.pin or 0].phase is SlotPhase.IDLE


@settings(max_examples=300)
@given(scenes(), st.booleans(), st.data())
def test_property_the_memo_of_ram_views_changes_no_decision(
    scene: tuple[Fleet, Fingerprint, tuple[int, int] | None], ram: bool, data: st.DataObject
) -> None:
    """A waiting request is decided again on every release with its memo of RAM views
    (``views``): the same decision as without it, before and after a claim changed a cache."""
    f, request, hint = scene
    chains = st.lists(st.integers(1, 4), min_size=1, max_size=5).map(lambda c: fp(*c))
    for backend in f.backends:
        backend.ram = ram
        parked = st.builds(RamEntry, chains, st.floats(0, 100))
        backend.ram_entries = data.draw(st.lists(parked, max_size=4))
    views: dict[int, RamView] = {}

    def both() -> Decision | NoPlacement:
        memo = route(request, f.backends, PARAMS, now=100.0, affinity=hint, views=views)
        assert memo == route(request, f.backends, PARAMS, now=100.0, affinity=hint)
        return memo

    first = both()
    if isinstance(first, Decision) and first.placement is not None:
        f.claim(first.placement, 101.0, request)
        both()


@given(scenes())
def test_property_no_fewer_reused_tokens_without_a_reason(
    scene: tuple[Fleet, Fingerprint, tuple[int, int] | None],
) -> None:
    """Choosing a slot that reuses less than the best idle one needs a stated reason."""
    f, request, _ = scene
    params = RoutingParams(min_prefix_tokens=0, eviction_weight=0.0)
    result = route(request, f.backends, params, now=100.0, allow_wait=False)
    if not isinstance(result, Decision) or result.placement is None:
        return
    best = max(
        (
            predicted_reuse(request, s, b.exact)
            for b in f.backends
            if b.phase is BackendPhase.READY
            for s in b.slots
            if s.phase is SlotPhase.IDLE
        ),
        default=0,
    )
    if result.predicted < best:
        assert result.reason is Reason.COLD
        assert best == 0


def test_ram_cache_takes_entries_oldest_first_when_they_beat_the_best_so_far() -> None:
    f = fleet(1)
    older, newer = RamEntry(fp(1, 2, 3, 8), 1.0), RamEntry(fp(1, 2, 3, 4, 9, 10, 11, 12), 2.0)
    f.backends[0].ram_entries = [older, newer]  # oldest first, like the server's list
    # older: keeps 300/400, similarity 300/500; newer keeps only 400/800: not better in both
    assert ram_reuse(fp(1, 2, 3, 4, 5), f.backends[0]) == 300
    f.backends[0].ram_entries = [newer]
    assert ram_reuse(fp(1, 2, 3, 4, 5), f.backends[0]) == 400


def test_a_parked_raw_prompt_is_loadable_only_by_its_real_length_with_the_reply() -> None:
    """llama-server saves a raw prompt's slot with the reply it generated, and loads an entry
    only for a prompt that keeps at least a quarter of it: a 16-token prompt saved with its
    64-token reply is not loaded for a prompt extending the 16 (16 / 80 < 0.25)."""
    request = Fingerprint(fp(1, 2, 3).hashes, (16, 32, 49))  # extends the parked prompt fp(1)
    for size, predicted in ((16, 16), (80, 0)):  # saved without a reply, and with one
        f = fleet(1)
        hold(f, 0, 0, fp(9))  # another conversation: pinning the slot consults the cache
        parked = replace(fp(1, size=16), sealed=True)  # a raw prompt, kept with its reply
        f.backends[0].ram_entries = [RamEntry(parked, 50.0, size=size)]
        assert decided(route(request, f.backends, PARAMS, now=100.0)).predicted == predicted


def test_a_slot_whose_reply_the_prompt_does_not_keep_is_parked_by_its_real_length() -> None:
    """The server parks a pinned slot's content when the prompt keeps less than half of the
    slot's KV, reply included: a 16-token prompt with a 64-token reply, then a prompt that
    extends the 16, keeps 16 of 80."""
    f = fleet(1)
    hold(f, 0, 0, replace(fp(1, size=16), sealed=True))  # as a raw prompt's reply leaves it
    f.backends[0].slots[0].n_tokens = 80
    f.claim(Placement(0, (0,), 0), now=101.0, content=Fingerprint(fp(1, 2, 3).hashes, (16, 32, 49)))
    assert [p.content.hashes for p in f.backends[0].ram_entries] == [fp(1).hashes]


def test_a_load_is_counted_on_only_when_the_slot_keeps_well_under_half() -> None:
    """The server consults its RAM cache when the pinned slot keeps under half of its content,
    in its own tokens; the router's shares are estimates, so it counts on a load only under
    ``SURE_CONSULT`` (Mooncake's two-block prompts: 64 of 144 estimated tokens, 16 of 32
    real ones, and no load)."""
    prompt = Fingerprint(fp(1, 2, 3, 4, 5, 6).hashes, (64, 128, 192, 256, 320, 384))
    for content, predicted in (
        (Fingerprint(fp(1, 91).hashes, (64, 144)), 64),  # keeps 0.44: the slot's own 64 only
        (
            Fingerprint(fp(1, 91, 92).hashes, (64, 144, 224)),
            320,
        ),  # keeps 0.29: the parked copy loads
    ):
        f = fleet(1)
        hold(f, 0, 0, content)
        f.backends[0].ram_entries = [
            RamEntry(Fingerprint(fp(1, 2, 3, 4, 5).hashes, prompt.tokens[:5]), 50.0)
        ]
        unprimed = replace(PARAMS, prime=False)
        d = decided(route(prompt, f.backends, unprimed, now=100.0))
        assert (d.reason, d.placement is not None, d.predicted) == (Reason.PREFIX, True, predicted)
        assert d.placement is not None
        assert not d.placement.primed
        # with a primer the load is certain: the server then consults its cache whatever the
        # slot keeps
        d = decided(route(prompt, f.backends, PARAMS, now=100.0))
        assert d.placement is not None
        assert d.predicted == 320
        assert d.placement.primed is (predicted == 64)


def test_a_slot_keeping_half_of_what_it_holds_is_primed_to_load_the_session() -> None:
    """The slot keeps half of what it holds, so the server would not consult its RAM cache,
    which holds the request's own session: a primer first, and the session loads; a primer
    is not worth it for another session's entry, nor for an entry serving no more than the
    slot's own content (by more than the primer's own tokens)."""
    f = fleet(1, 1)
    hold(f, 0, 0, fp(1, 90, size=40))
    own = RamEntry(fp(1, 2, 3, 4, 5, 6, size=40), 50.0)
    f.backends[0].ram_entries = [own]
    prompt = fp(1, 2, 3, 4, 5, 6, 7, 8, size=40)
    d = decided(route(prompt, f.backends, PARAMS, now=100.0))
    assert d.placement is not None
    assert d.placement.primed
    assert d.placement.from_ram is own
    assert d.predicted == 240
    f.claim(d.placement, now=100.0, content=prompt)
    entries = f.backends[0].ram_entries
    assert [e.content for e in entries] == [fp(1, 90, size=40)]  # the primer's hook parked it

    # conversations (anchored at their third segment) under one system prompt of two: a
    # parked entry of another is not loaded, nor one serving no more than the slot does
    def chat(*segments: int) -> Fingerprint:
        return replace(fp(*segments, size=40), anchor=3)

    for entry, content, predicted in (
        (chat(1, 2, 50), chat(1, 91), 40),  # keeps half of it: no consult
        (chat(1, 2, 3), chat(1, 2, 3, 90), 120),
    ):
        f = fleet(1)
        hold(f, 0, 0, content)
        f.backends[0].ram_entries = [RamEntry(entry, 50.0)]
        d = decided(route(chat(1, 2, 3, 4), f.backends, PARAMS, now=100.0))
        assert d.placement is not None
        assert not d.placement.primed, entry
        assert d.predicted == predicted


def test_a_backend_whose_free_slots_cannot_load_its_ram_copy_is_waited_for() -> None:
    """b0's RAM cache holds most of the prompt, but its one free slot keeps half of what it
    holds (the server would not consult the cache): without a primer the request waits for
    b0's busy slot, which will load the copy once done, rather than take the free slot or an
    empty one; with one, it primes the free slot at once."""
    f = fleet(2, 1)
    hold(f, 0, 0, fp(1, 2, 3, 4, 5, 6, size=40))
    f.claim(Placement(0, (0,), 0), now=100.0, content=fp(1, 90, size=40))  # parks fp(1..6)
    f.release(Placement(0, (0,), 0), now=100.0, clean=True, content=fp(1, 90, size=40))
    f.claim(Placement(0, (1,), 1), now=100.0, content=fp(70, 71, 72, size=40))
    prompt = fp(1, 2, 3, 4, 5, 6, 7, 8, size=40)
    d = decided(route(prompt, f.backends, PARAMS, now=100.0))
    assert d.placement is not None
    assert d.placement.primed
    assert (d.placement.backend, d.placement.pin, d.predicted) == (0, 0, 240)
    d = decided(route(prompt, f.backends, replace(PARAMS, prime=False), now=100.0))
    assert (d.reason, d.wait_for, d.predicted) == (Reason.WAIT, (0, -1), 240)
    f.release(Placement(0, (1,), 1), now=101.0, clean=True, content=fp(70, 71, 72, size=40))
    d = decided(route(prompt, f.backends, PARAMS, now=101.0))
    assert d.placement is not None
    assert d.placement.from_ram is not None
    assert (d.placement.backend, d.placement.pin, d.predicted) == (0, 1, 240)


def test_a_parked_turn_the_server_may_load_in_a_tie_is_counted_as_loaded() -> None:
    """Magagent: a request shares only the system prompt with both the pinned slot's content
    and another session's parked turn; by segments they tie, by the server's exact tokens the
    parked turn may share a few more and be loaded (and overwritten). The router counts the
    load: the placement carries it and the entry leaves the model of the cache, where before
    it stayed as a phantom that the session's next turn was routed to and missed."""
    f = fleet(1)
    hold(f, 0, 0, fp(1, 50, 51, 52))
    parked = RamEntry(fp(1, 60, 61), 90.0)
    f.backends[0].ram_entries = [parked]
    d = decided(route(fp(1, 70, 71, 72), f.backends, PARAMS, now=100.0))
    assert d.placement is not None
    assert d.placement.from_ram == parked
    f.claim(d.placement, now=100.0, content=fp(1, 70, 71, 72))
    assert parked not in f.backends[0].ram_entries


def pieces(ids: list[int], offset: int) -> tuple[Part, ...]:
    """Each segment's four pieces (``Fingerprint.parts``): segments 1 and 2 share their first
    two, 3 and 4 their first three, after the same segments before them."""
    out = []
    for i, s in enumerate(ids):
        family, alike = (1, 2) if s <= 2 else (3, 3)
        chained = [
            hash((tuple(ids[:i]), family if j < alike else s, j)) & (2**64 - 1) for j in range(4)
        ]
        packed = b"".join(h.to_bytes(8, "little") for h in chained)
        out.append((i + offset, 4 * PART_BYTES, packed))
    return tuple(out)


@st.composite
def wide_scenes(draw: st.DrawFn) -> tuple[Fleet, Fingerprint, tuple[int, int] | None]:
    """Up to three backends of up to six slots; chains that may open with an empty
    preamble (a chat template's, no token) shared by every prompt: a chat prompt's, whose
    user messages may be known (the first one ends the anchor), or a raw prompt's. A chat
    prompt's segments are long: segments 1 and 2 start alike (two of their four pieces),
    and so do 3 and 4 (three), so chains may part inside a message (``shared_tokens``)."""
    counts = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    f = fleet(*counts, exact=tuple(draw(st.booleans()) for _ in counts))
    preamble = draw(st.booleans())
    user = draw(st.integers(1, 5))  # segment ids from this one up are user messages

    def chain(ids: list[int], kind: str) -> Fingerprint:
        """The anchor (the first user message) follows from the content, as it does for a
        real prompt: two slots holding one chain never differ in it. ``kind``: a chat
        prompt's, its user messages known or not, or a raw prompt's (no anchor)."""
        c = fp(0, *ids) if preamble else fp(*ids)
        tokens = tuple(t - 100 for t in c.tokens) if preamble else c.tokens
        if kind == "raw":
            return Fingerprint(c.hashes, tokens)
        anchor = next((i + 1 for i, s in enumerate(ids) if s >= user), len(ids)) + preamble
        known = kind == "chat"
        users = tuple(i + preamble for i, s in enumerate(ids) if s >= user) if known else ()
        return Fingerprint(c.hashes, tokens, anchor, users=users, parts=pieces(ids, preamble))

    ids = st.lists(st.integers(1, 4), min_size=1, max_size=5)
    chains = st.builds(chain, ids, st.sampled_from(["chat", "anchored", "raw"]))
    for backend in f.backends:
        backend.ram = draw(st.booleans())
        parked = st.builds(RamEntry, chains, st.floats(0, 100))
        backend.ram_entries = draw(st.lists(parked, max_size=3))
        for slot in backend.slots:
            slot.phase = draw(st.sampled_from(list(SlotPhase)))
            slot.content = draw(st.none() | chains)
            slot.pending = draw(st.none() | chains) if slot.phase is SlotPhase.BUSY else None
            slot.last_used = draw(st.sampled_from([0.0, 50.0, 99.0]))
    hint = draw(st.none() | st.tuples(st.integers(0, 3), st.integers(0, 5)))
    return f, draw(chains), hint


@settings(max_examples=400)
@given(
    wide_scenes(),
    st.booleans(),
    st.sampled_from([0.0, 50.0]),
    st.sampled_from([0.1, 0.0]),
)
def test_property_scoring_a_few_slots_per_backend_decides_as_scoring_all(
    scene: tuple[Fleet, Fingerprint, tuple[int, int] | None],
    allow_wait: bool,
    hold: float,
    discount: float,
) -> None:
    """``core.routing.options`` scores the idle slots sharing a token with the prompt (those of
    another conversation only while their bound may beat the best so far) and the best of the
    others, and ``core.routing.waiting`` weighs one busy slot per distinct content:
    the decision is the one weighing every slot gives."""
    import proxy.core.routing.decision as routing
    from proxy.core.routing.index import BackendIndex

    f, request, hint = scene

    def decide() -> Decision | NoPlacement:
        return route(
            request,
            f.backends,
            replace(PARAMS, ram_discount=discount),
            now=100.0,
            affinity=hint,
            allow_wait=allow_wait,
            hold=hold,
        )

    pruned = decide()

    def every_idle_slot(
        fp: Any,
        b: Any,
        index: Any,
        spared: Any,
        now: Any,
        params: Any,
        ram: Any,
        load: Any,
        offer: Any,
    ) -> tuple[list[Any], list[Any], None, None]:
        return (
            [
                candidate(fp, b, s, now, params, ram[b.index], load, offer)
                for s in b.slots
                if s.phase is SlotPhase.IDLE and s.id not in spared
            ],
            [],
            None,
            None,
        )

    with (
        mock.patch.object(routing, "options", every_idle_slot),
        # every backend's RAM view read (its index's bound never passes one over)
        mock.patch.object(RamViews, "most", return_value=1 << 40),
        mock.patch.object(waiting, "_distinct_busy", lambda sharing: list(sharing)),
        # every busy slot, sharing the prompt's head or not
        mock.patch.object(BackendIndex, "waiting", lambda self, key: list(self.busy)),
        # (no busy slot of another conversation skipped either)
        mock.patch.object(waiting, "continues", return_value=True),
    ):
        assert pruned == decide()


@settings(max_examples=300)
@given(wide_scenes(), st.sampled_from([None, 0.5, 3.0]))
def test_property_a_ram_view_read_by_heads_is_the_view_of_every_entry(
    scene: tuple[Fleet, Fingerprint, tuple[int, int] | None], scale: float | None
) -> None:
    """``scoring.ram_view`` compares the prompt only with the RAM entries of its head
    (``index.BackendIndex.ram_heads``): the entries that serve it a token, what they serve
    (at most ``BackendIndex.ram_most``), and what the server loads for any slot are the ones
    comparing every entry gives; and
    with what the slots hold (``BackendIndex.holds``) an entry's damage is the
    one scanning the slots gives, until a slot changes."""
    from proxy.core.routing.index import FleetIndex
    from proxy.core.server.ram_cache import pick

    f, request, _ = scene
    for backend in f.backends:
        backend.ram, backend.token_scale = True, scale
        by_heads = ram_view(request, backend, None, FleetIndex().of(backend).ram_heads)
        every = ram_view(request, backend)
        assert by_heads.loadable == every.loadable
        for i in every.loadable:
            assert (by_heads.served[i], by_heads.shared[i]) == (every.served[i], every.shared[i])
        grouped = FleetIndex().of(backend)
        assert all(grouped.ram_most(request) >= every.served[i][0] for i in every.loadable)
        resident = ram_view(request, backend, None, grouped.ram_heads, grouped.holds)
        for i in range(len(backend.ram_entries)):  # a copy of a slot's content loses nothing
            damage = by_heads.damage(i, 100.0, PARAMS, backend)
            assert resident.damage(i, 100.0, PARAMS, backend) == damage
        if backend.ram_entries:  # a slot now holds the first entry: the kept prefixes are stale
            backend.slots[0].pending, backend.slots[0].phase = None, SlotPhase.IDLE
            backend.slots[0].content = backend.ram_entries[0].content
            assert resident.damage(0, 100.0, PARAMS, backend) == 0.0
        for kept, length in ((0, 0), (0, 300), (100, 300), (200, 250)):
            for skip in range(len(backend.ram_entries) + 1):
                found = pick(every.served[skip:], kept, length, request.total)
                whole = None if found is None else found + skip  # (every entry read)
                assert by_heads.pick(kept, length, skip) == every.pick(kept, length, skip) == whole


def chain(rest: list[int], size_of: dict[int, int], user: int) -> Fingerprint:
    """The chain of segment ids ``1, *rest``, each segment's size and whether it is a user
    message (ids from ``user`` up; the anchor runs up to and including the first) following
    from its id, as they follow from a real prompt's content."""
    ids = (1, *rest)
    tokens = tuple(itertools.accumulate(size_of[k] for k in ids))
    users = tuple(i for i, k in enumerate(ids) if k >= user)
    anchor = users[0] + 1 if users else len(ids)
    parts = pieces(list(ids), 0)  # (long segments: chains may part inside one)
    return Fingerprint(fp(*ids).hashes, tokens, anchor, users=users, parts=parts)


@st.composite
def kin_scenes(draw: st.DrawFn) -> tuple[BackendState, Fingerprint]:
    """One backend whose slots and RAM entries hold chains opening with the request's first
    segment (most of them kin of the request), of varied segment sizes, with checkpoints.
    A segment's size, and which segments are user messages (the anchor is the first), follow
    from its id, as they follow from a real prompt's content."""
    size_of = {k: draw(st.sampled_from([50, 100, 300])) for k in range(1, 5)}
    user = draw(st.integers(2, 5))  # segment ids from this one up are user messages
    sized = st.lists(st.integers(2, 4), max_size=4).map(lambda rest: chain(rest, size_of, user))
    f = fleet(draw(st.integers(1, 4)), exact=(draw(st.booleans()),))
    backend = f.backends[0]
    backend.ram = draw(st.booleans())
    backend.ram_entries = draw(st.lists(st.builds(RamEntry, sized, st.floats(0, 100)), max_size=3))
    for slot in backend.slots:
        slot.content = draw(sized)
        slot.last_used = draw(st.sampled_from([0.0, 50.0, 99.0]))
    return backend, draw(sized)


@settings(max_examples=600)
@given(kin_scenes(), st.sampled_from([None, 150, 450]), st.sampled_from([0.0, 0.1, 1.0]))
def test_property_a_kin_slots_bound_is_never_below_its_score(
    scene: tuple[BackendState, Fingerprint],
    offer_tokens: int | None,
    discount: float,
) -> None:
    """``scoring.kin_bound`` bounds ``candidate``'s score of every idle slot that shares a
    token with the prompt but not its anchor, whatever the RAM cache, a snapshot offer, the
    model (exact or not, with checkpoints) and the RAM discount: the decision may skip a slot
    whose bound is below the best score found (``options.kin``)."""
    from proxy.core.routing.index import FleetIndex
    from proxy.core.routing.options import options
    from tests.unit.test_snapshots import offer as restore_offer

    backend, request = scene
    params = replace(PARAMS, ram_discount=discount)
    offer = None if offer_tokens is None else restore_offer(offer_tokens, offer_tokens / 4)
    ram = ram_view(request, backend)
    ceiling = kin_ceiling(kin_reach(request), backend, ram, offer)
    loads = kin_loads(ceiling, ram, 100.0, params, backend)
    index = FleetIndex().of(backend)
    views = RamViews(request, [backend], [backend], {backend.index: index})
    _, kin, _, _ = options(request, backend, index, frozenset(), 100.0, params, views, 0, offer)
    # what the index says any entry serves at most bounds what each serves
    assert all(index.ram_most(request) >= ram.served[i][0] for i in ram.loadable)
    for slot in kin:
        score = candidate(request, backend, slot, 100.0, params, ram, 0, offer).score
        assert kin_bound(request, backend, slot, 100.0, params, ceiling) >= score
        assert kin_bound(request, backend, slot, 100.0, params, loads) >= score


def test_a_kin_slots_bound_counts_the_ram_entry_the_server_would_load_into_it() -> None:
    """A slot of another conversation that keeps under 0.4 of its content makes the server
    load its best RAM entry: the request's own earlier prompt, parked there, serves 300 tokens
    where the slot serves 100. The bound must count the entry (the property above rarely draws
    this case)."""

    request = replace(fp(1, 2, 3, 4), anchor=2)
    f = fleet(2)
    backend = f.backends[0]
    hold(f, 0, 0, fp(1, 5, 6, 7), at=99.0)
    backend.ram_entries = [RamEntry(fp(1, 2, 3), 99.0)]
    ram = ram_view(request, backend)
    found = candidate(request, backend, backend.slots[0], 100.0, PARAMS, ram, 0, None)
    assert (found.reuse, found.from_ram) == (300, backend.ram_entries[0])
    ceiling = kin_ceiling(kin_reach(request), backend, ram, None)
    bound = kin_bound(request, backend, backend.slots[0], 100.0, PARAMS, ceiling)
    assert bound >= found.score > 200


def test_a_kin_slot_that_loads_more_than_the_sessions_own_slot_serves_is_scored() -> None:
    """The session's own slot (b0) holds only its first turn: 200 tokens. On b1 a slot of
    another conversation under the same system prompt would make the server load the
    session's longer prompt, parked in b1's RAM cache: 300 tokens. That backend's most gain
    (300) is above the best score found (200), so its kin are scored, and the load wins; a
    backend is passed over only when its most gain is below the best."""
    request = replace(fp(1, 2, 3, 4), anchor=2)
    f = fleet(1, 1)
    hold(f, 0, 0, replace(fp(1, 2), anchor=2), at=99.0)
    hold(f, 1, 0, replace(fp(1, 5, 6, 7), anchor=2), at=20.0)
    f.backends[1].ram_entries = [RamEntry(replace(fp(1, 2, 3), anchor=2), 99.0)]
    d = decided(route(request, f.backends, PARAMS, now=100.0, allow_wait=False))
    assert d.placement is not None
    assert (d.placement.backend, d.predicted) == (1, 300)
    assert d.placement.from_ram is f.backends[1].ram_entries[0]


def test_a_kin_slots_bound_on_an_exact_backend_counts_no_reuse_of_its_own() -> None:
    """An exact backend rolls a slot that diverges inside its content back to a checkpoint,
    or to nothing: the request may keep none of the slot, so the server may park it (the RAM
    discount), however much the prompt's first segment is of it."""

    request = replace(fp(1, 2, 3), anchor=2)
    f = fleet(2, exact=(True,))
    backend = f.backends[0]
    hold(f, 0, 0, replace(fp(1, 5), anchor=2), at=50.0)
    ram = ram_view(request, backend)
    found = candidate(request, backend, backend.slots[0], 100.0, PARAMS, ram, 0, None)
    assert found.reuse == 0
    ceiling = kin_ceiling(kin_reach(request), backend, ram, None)
    assert kin_bound(request, backend, backend.slots[0], 100.0, PARAMS, ceiling) >= found.score


def test_strangers_with_no_ram_entry_to_load_are_ranked_exactly() -> None:
    """A RAM entry shares the request's system prompt, but the prompt keeps under a quarter of
    it: the server loads nothing. The backend's idle slots share nothing with the prompt: two
    hold raw prompts (anchor 0: the request would overwrite them whole, no RAM discount, 40
    and 45 tokens lost), one another chat (parked in RAM: 300 x 0.1 = 30). The chat slot is
    the cheapest to take, though the two raw ones hold less."""

    def chat(*ids: int, size: int) -> Fingerprint:  # a system prompt, then a user message
        c = fp(*ids, size=size)
        return Fingerprint(c.hashes, c.tokens, 2, users=(1,))

    request = chat(1, 2, size=100)
    f = fleet(3)
    backend = f.backends[0]
    backend.ram_entries = [RamEntry(chat(1, 3, 4, 5, 6, size=100), 90.0)]  # 100 of 500
    hold(f, 0, 0, fp(7, size=40))
    hold(f, 0, 1, fp(8, size=45))
    hold(f, 0, 2, chat(9, 10, size=150))
    view = ram_view(request, backend)
    assert not view.loadable
    scores = [candidate(request, backend, s, 100.0, PARAMS, view).score for s in backend.slots]
    assert scores == [-40.0, -45.0, -30.0]
    d = decided(route(request, f.backends, PARAMS, now=100.0))
    assert d.placement == Placement(0, (2,), 2)


def test_spare_strangers_holding_raw_and_chat_contents_are_all_scored() -> None:
    """A disk snapshot nets 140 tokens in any slot. The restore overwrites the two raw
    prompts' contents undiscounted (40 and 45 tokens lost), the chat one parked in RAM
    (300 x 0.1 = 30): the chat slot is the cheapest, though ordered by one discount it
    would lose the most."""
    from tests.unit.test_snapshots import offer

    def chat(*ids: int, size: int) -> Fingerprint:
        c = fp(*ids, size=size)
        return Fingerprint(c.hashes, c.tokens, 2, users=(1,))

    request = chat(1, 2, size=100)
    f = fleet(3)
    backend = f.backends[0]
    hold(f, 0, 0, fp(7, size=40))
    hold(f, 0, 1, fp(8, size=45))
    hold(f, 0, 2, chat(9, 10, size=150))
    snapshot = offer(150, 10.0)
    view = ram_view(request, backend)
    scores = [
        candidate(request, backend, s, 100.0, PARAMS, view, 0, snapshot).score
        for s in backend.slots
    ]
    assert scores == [100.0, 95.0, 110.0]
    d = decided(route(request, f.backends, PARAMS, now=100.0, disk={0: snapshot}))
    assert d.placement is not None
    assert d.placement.slots == (2,)


def test_with_no_eviction_weight_the_spare_strangers_are_the_least_recently_used() -> None:
    """A loss that counts nothing (an eviction weight of 0, as ``bench.ablation`` drops it):
    every slot sharing nothing with the prompt scores what the RAM entry loaded into it
    serves, so the least recently used wins the tie, however much it holds."""
    request = fp(1, 2, 3, 4, size=10)
    f = fleet(3)
    backend = f.backends[0]
    backend.ram_entries = [RamEntry(fp(1, 2, 9, size=10), 90.0)]  # serves 20 tokens
    for i, (size, at) in enumerate([(500, 0.0), (10, 50.0), (10, 50.0)]):
        c = fp(5 + i, 8, size=size)
        hold(f, 0, i, Fingerprint(c.hashes, c.tokens, 2), at=at)
    params = replace(PARAMS, eviction_weight=0.0)
    view = ram_view(request, backend)
    scores = [candidate(request, backend, s, 100.0, params, view).score for s in backend.slots]
    assert scores == [20.0, 20.0, 20.0]
    d = decided(route(request, f.backends, params, now=100.0, allow_wait=False))
    assert d.placement == Placement(0, (0,), 0, backend.ram_entries[0])


def test_a_loss_cannot_count_as_a_gain() -> None:
    """A negative eviction weight would make overwriting more worth more, and no bound of a
    slot's score would hold: the parameters refuse it."""
    with pytest.raises(ValueError, match="eviction_weight"):
        RoutingParams(eviction_weight=-1.0)


def test_a_spare_strangers_most_counts_an_entry_serving_less_that_destroys_less() -> None:
    """The server loads the older entry (all of it serves the prompt: 200 tokens, none lost)
    rather than the newer one that serves 300 but keeps under a third of its 1,000 tokens
    (``ram_cache.pick``: a higher keep share first). The most a slot sharing nothing can
    score counts that entry, though another serves more: of the entries, only one serving
    as much or more for a smaller loss bounds another (``scoring.kin_loads``)."""
    request = fp(1, 2, 3, 4)
    f = fleet(1)
    backend = f.backends[0]
    backend.ram_tokens = 10_000  # a budget: which entry is loaded may differ from slot to slot
    hold(f, 0, 0, fp(5, 6), at=100.0)  # another system prompt: shares nothing
    older, newer = RamEntry(fp(1, 2), 90.0), RamEntry(fp(1, 2, 3, 7, 8, 9, 10, 11, 12, 13), 99.0)
    backend.ram_entries = [older, newer]
    ram = ram_view(request, backend)
    found = candidate(request, backend, backend.slots[0], 100.0, PARAMS, ram, 0, None)
    assert (found.reuse, found.from_ram) == (200, older)
    loads = kin_loads(
        kin_ceiling(kin_reach(request), backend, ram, None), ram, 100.0, PARAMS, backend
    )
    bare = stranger_ceiling(loads, ram, 100.0, PARAMS, backend)
    assert stranger_most(bare, PARAMS, hollow=False) >= found.score > 150


@settings(max_examples=200)
@given(wide_scenes(), st.data())
def test_property_an_index_kept_across_changes_decides_as_one_built_anew(
    scene: tuple[Fleet, Fingerprint, tuple[int, int] | None], data: st.DataObject
) -> None:
    """``core.routing.index`` keeps each backend's grouped slots while the backend is unchanged:
    after any change of a slot or a backend (through ``Fleet`` or written directly, as the
    disk tier writes a restored slot), a decision with the kept index is the one a fresh
    index gives."""
    from proxy.core.routing.index import FleetIndex

    f, request, hint = scene
    kept = FleetIndex()
    chains = st.lists(st.integers(1, 4), min_size=1, max_size=5).map(lambda ids: fp(*ids))
    for _ in range(data.draw(st.integers(1, 6))):
        for index in (kept, None):  # the kept one first: it is built, then reused
            now = data.draw(st.sampled_from([100.0, 160.0]))
            hold = data.draw(st.sampled_from([0.0, 50.0]))
            args: dict[str, Any] = {"now": now, "affinity": hint, "hold": hold}
            assert route(request, f.backends, PARAMS, index=kept, **args) == route(
                request, f.backends, PARAMS, index=index, **args
            )
        backend = data.draw(st.sampled_from(f.backends))
        slot = data.draw(st.sampled_from(backend.slots))
        change = data.draw(st.sampled_from(["content", "phase", "used", "scale", "ram", "probe"]))
        if change == "content":
            slot.content = data.draw(st.none() | chains)
        elif change == "phase":
            slot.phase = data.draw(st.sampled_from(list(SlotPhase)))
        elif change == "used":
            slot.last_used = data.draw(st.sampled_from([10.0, 90.0, 150.0]))
        elif change == "scale":
            backend.token_scale = data.draw(st.sampled_from([None, 0.5, 2.0]))
        elif change == "ram":
            backend.ram = not backend.ram
        else:
            count = data.draw(st.integers(1, 4))
            probe = Probe(
                BackendPhase.READY, tuple(SlotProbe(i, False, 0, -1) for i in range(count))
            )
            f.apply_probe(backend.index, probe, now=120.0)
        request = data.draw(
            st.sampled_from([request, *(s.content for s in backend.slots if s.content)])
        )


@settings(max_examples=300)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(1, 4), min_size=1, max_size=4),
            st.integers(0, 2),
            st.sampled_from([0.0, 30.0, 60.0, 99.5]),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
    ),
    st.booleans(),
    st.sampled_from([None, 0.5, 3.0]),
    st.sampled_from([0.0, 0.1, 1.0]),
)
def test_property_the_stranger_found_by_loss_is_the_best_of_all(
    held: list[tuple[list[int], int, float, bool]],
    ram: bool,
    scale: float | None,
    discount: float,
) -> None:
    """``options.strangers`` ranks exactly only the first few strangers by loss
    (``index.least_lost``): the slot it finds is the one ranking every stranger finds, whatever
    the contents' anchors (a raw prompt's content is not parked), lengths, sealed replies
    and last uses."""
    from proxy.core.routing.index import FleetIndex
    from proxy.core.routing.options import Strangers, _stranger_ranks, strangers

    f = fleet(len(held))
    backend = f.backends[0]
    backend.ram, backend.token_scale = ram, scale
    for slot, (ids, anchor, used, sealed) in zip(backend.slots, held, strict=True):
        content = fp(*ids)
        slot.content = replace(content, anchor=min(anchor, len(ids)), sealed=sealed)
        slot.last_used, slot.n_tokens = used, 150 * len(ids)
    request = fp(9, 8)  # shares no token with any slot
    params = replace(PARAMS, ram_discount=discount)
    left = Strangers(backend, FleetIndex().of(backend), frozenset())
    every = max(_stranger_ranks(request, backend, 100.0, params, 0, backend.slots))
    for _ in range(3):  # the first read ranks every stranger, the second walks the order
        # kept, the third reads what the second found (nothing to skip: kept with the index)
        [found] = strangers(request, [left], 100.0, params, {0: 0})
        assert (found.slot, found.score) == (every[3], every[0])


def test_with_no_ram_discount_the_spare_strangers_are_the_rankings_ties() -> None:
    """The server parks what a stranger holds at no cost (discount 0): the three strangers
    that would load the prompt's RAM entry tie, and the slot taken is the one ranking every
    slot takes (the least recently used, then the lowest id), not the one losing least."""
    f = fleet(6, 1)
    backend = f.backends[0]
    request = replace(fp(7), anchor=1)
    backend.ram_entries = [RamEntry(request, 0.0)]
    hold(f, 0, 0, replace(fp(1), anchor=1), at=50.0)
    hold(f, 0, 4, replace(fp(1, 2), anchor=1), at=0.0)  # loses more, as old as slot 5
    hold(f, 0, 5, replace(fp(1), anchor=1), at=0.0)
    f.backends[1].ram = False
    params = replace(PARAMS, ram_discount=0.0)
    d = decided(route(request, f.backends, params, now=100.0, allow_wait=False))
    assert d.placement is not None
    assert (d.placement.backend, d.placement.pin) == (0, 4)


def test_the_cheapest_stranger_kept_with_a_grouping_is_read_past_the_slots_skipped() -> None:
    """What ``BackendIndex.cheapest`` keeps for a read skipping no slot is not the answer to
    one that skips some (the slots sharing the prompt): that one walks the order."""
    from proxy.core.routing.index import FleetIndex

    f = fleet(3)
    for slot in f.backends[0].slots:
        hold(f, 0, slot.id, fp(10 + slot.id), at=10.0 * slot.id)  # slot 0 the least recent
    index = FleetIndex().of(f.backends[0])
    reads = [index.cheapest(600.0, 0.1, frozenset()) for _ in range(3)]
    assert reads[0] is None  # (the first read of a grouping: no order kept yet)
    assert [found[1] for found in reads[1:] if found] == [[f.backends[0].slots[0]]] * 2
    past = index.cheapest(600.0, 0.1, frozenset({0}))
    assert past is not None
    assert list(past[1]) == [f.backends[0].slots[1]]


@settings(max_examples=300)
@given(
    st.lists(
        st.tuples(
            st.none() | st.lists(st.integers(1, 4), min_size=1, max_size=4),
            st.sampled_from([0.0, 30.0, 60.0, 99.5, 130.0]),
            st.sampled_from([0, 120, 480]),
            st.booleans(),
        ),
        min_size=1,
        max_size=7,
    ),
    st.sets(st.integers(0, 6)),
    st.sampled_from([None, 0.5, 3.0]),
    st.booleans(),
)
def test_property_the_spare_strangers_found_by_loss_are_the_cheapest_of_all(
    held: list[tuple[list[int] | None, float, int, bool]],
    skip: set[int],
    scale: float | None,
    exact: bool,
) -> None:
    """On a backend with a RAM entry or a snapshot for the prompt, the spare strangers
    (``options._cheapest``) are found among the first few slots by loss: they are the
    ``SPARES`` that sorting every stranger by its loss finds, and the least recently used
    empty one, whatever the lengths (sealed replies, the token scale), last uses (some after
    ``now``: then every stranger is sorted) and slots left out."""
    from proxy.core.routing.index import FleetIndex
    from proxy.core.routing.options import SPARES, Strangers, _cheapest
    from proxy.core.routing.scoring import recency

    f = fleet(len(held), exact=(exact,))
    backend = f.backends[0]
    backend.ram, backend.token_scale = True, scale
    for slot, (ids, used, n_tokens, sealed) in zip(backend.slots, held, strict=True):
        slot.content = None if ids is None else replace(fp(*ids), sealed=sealed)
        slot.last_used, slot.n_tokens = used, n_tokens
    left = Strangers(backend, FleetIndex().of(backend), frozenset(skip))
    first, found = _cheapest(left, 100.0, PARAMS), _cheapest(left, 100.0, PARAMS)
    assert first == found  # (the first read ranks every stranger, the second the order kept)
    assert _cheapest(left, 100.0, PARAMS) == found  # (a third: what the second found, kept)

    def cost(slot: SlotState) -> tuple[float, float, int]:
        assert slot.content is not None
        lost = backend.kv_estimate(slot.content, slot.n_tokens)
        return (lost * recency(slot, 100.0, PARAMS, backend), slot.last_used, slot.id)

    slots = left.slots()
    every = sorted((s for s in slots if s.content is not None), key=cost)[:SPARES]
    empty = sorted((s for s in slots if s.content is None), key=lambda s: (s.last_used, s.id))
    assert found == every + empty[:1]


@settings(max_examples=300)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(2, 4), max_size=4),
            st.sampled_from([*SlotPhase, SlotPhase.BUSY, SlotPhase.BUSY]),
        ),
        min_size=8,
        max_size=8,
    ),
    st.lists(st.integers(2, 4), min_size=1, max_size=4),
    st.fixed_dictionaries({k: st.sampled_from([50, 100]) for k in range(1, 5)}),
    st.integers(2, 5),
)
def test_property_waiting_skips_only_busy_slots_that_cannot_save_more(
    held: list[tuple[list[int], SlotPhase]],
    asked: list[int],
    size_of: dict[int, int],
    user: int,
) -> None:
    """A busy slot of another conversation (it shares the prompt's head, not its anchor)
    saves at most the prompt before its anchor, so ``waiting.worth_waiting`` does not work it
    out once a wait saving that much was found: the decision is the one weighing it gives."""
    import proxy.core.routing.waiting as waiting

    f = fleet(4, 4)
    for (ids, phase), slot in zip(held, [s for b in f.backends for s in b.slots], strict=True):
        content = chain(ids, size_of, user)
        slot.content, slot.phase, slot.last_used = content, phase, 50.0
        slot.pending = content if phase is SlotPhase.BUSY else None
    request = chain(asked, size_of, user)

    def decide() -> Decision | NoPlacement:
        return route(request, f.backends, PARAMS, now=100.0, queued=9)

    skipping = decide()
    with mock.patch.object(waiting, "continues", return_value=True):
        assert skipping == decide()


@settings(max_examples=300)
@given(
    kin_scenes(),
    st.lists(st.lists(st.integers(5, 7), min_size=1, max_size=3), min_size=1, max_size=3),
    st.sampled_from([None, 150, 450]),
    st.sampled_from([0.0, 0.1, 1.0]),
    st.sampled_from([None, 200, 600]),
    st.booleans(),
)
def test_property_a_spare_strangers_bound_is_never_below_its_score(
    scene: tuple[BackendState, Fingerprint],
    held: list[list[int]],
    offer_tokens: int | None,
    discount: float,
    budget: int | None,
    empty: bool,
) -> None:
    """A stranger that a RAM entry or a snapshot may serve (``options``' spares) reuses
    nothing of its own, so the server may park all of it: its bound (``kin_bound`` with no
    floor, or with ``stranger_ceiling``: with no RAM budget, the one entry the server would
    load into it, less what that destroys) is never below ``candidate``'s score, whatever
    the prompt's first segment and the RAM budget, and never above ``stranger_most``."""
    from proxy.core.routing.index import FleetIndex
    from tests.unit.test_snapshots import offer as restore_offer

    backend, request = scene
    for slot, ids in zip(backend.slots, held, strict=False):
        slot.content = fp(*ids, size=50)  # shares no token with the request (it opens with 1)
    if empty and len(backend.slots) > len(held):
        backend.slots[-1].content = None
    backend.ram_tokens = budget
    params = replace(PARAMS, ram_discount=discount)
    offer = None if offer_tokens is None else restore_offer(offer_tokens, offer_tokens / 4)
    ram = ram_view(request, backend)
    ceiling = kin_ceiling(kin_reach(request), backend, ram, offer)
    loads = kin_loads(ceiling, ram, 100.0, params, backend)
    bare = stranger_ceiling(loads, ram, 100.0, params, backend)
    hollow = FleetIndex().of(backend).hollow
    for slot in backend.slots[: len(held)]:
        score = candidate(request, backend, slot, 100.0, params, ram, 0, offer).score
        assert kin_bound(request, backend, slot, 100.0, params, ceiling._replace(floor=0)) >= score
        bound = kin_bound(request, backend, slot, 100.0, params, bare)
        assert stranger_most(bare, params, hollow) >= bound >= score
    for slot in backend.slots:  # and one holding no token (empty, or a content of none)
        if slot.content is None or not slot.content.total:
            score = candidate(request, backend, slot, 100.0, params, ram, 0, offer).score
            assert stranger_most(bare, params, hollow) >= score


def test_no_primer_when_its_saves_push_the_session_out_of_a_ram_budget() -> None:
    """Under a RAM budget the primer's hook saves the slot's content, and the request's own
    hook saves the primer, before the session loads: when those push the session's entry
    out (it is the oldest), the primer would load nothing of it."""
    for budget, primed in ((330, False), (400, True)):
        f = Fleet(["b0"], ram_tokens=[budget])
        probe = Probe(BackendPhase.READY, (SlotProbe(0, False, 0, -1),))
        f.apply_probe(0, probe, now=0.0)
        hold(f, 0, 0, fp(1, 90, size=40))  # 80 tokens, half of them the prompt's
        f.backends[0].ram_entries = [RamEntry(fp(1, 2, 3, 4, 5, 6, size=40), 50.0)]  # 240
        d = decided(route(fp(1, 2, 3, 4, 5, 6, 7, size=40), f.backends, PARAMS, now=100.0))
        assert d.placement is not None
        assert d.placement.primed is primed, budget


def test_slots_with_one_chain_told_apart_by_their_user_messages_are_both_options() -> None:
    """Two idle slots holding one chain, one whose user messages are known (a chat content)
    and one whose are not: they score differently (which conversation each is), so neither
    stands for the other (one stood for both, and the decision differed from scoring every
    slot, a property test's counterexample); nor do two busy slots."""
    chain = fp(1, 2, 3, 4, 5)
    chat, anchored = replace(chain, anchor=2, users=(1, 2)), replace(chain, anchor=2)
    slots = [SlotState(0), SlotState(1), SlotState(2)]
    for slot, content in zip(slots, (chat, anchored, chat), strict=True):
        slot.content = content
    assert [s.id for s in options._distinct(slots)] == [0, 1]
    for slot in slots:
        slot.phase, slot.pending = SlotPhase.BUSY, slot.content
    assert [s.id for s in waiting._distinct_busy(slots)] == [0, 1]
