"""The model of llama-server's host-RAM prompt cache (``proxy.core.server.ram_cache``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.core.prompt.fingerprint import Fingerprint, common_segments
from proxy.core.server import ram_cache
from proxy.core.server.fleet import Placement
from proxy.core.server.ram_cache import RamEntry
from tests.unit.test_routing import fleet, hold
from tests.unit.test_routing import fp as segments_fp


def fp(*segments: int) -> Fingerprint:
    return Fingerprint(tuple(segments), tuple(100 * (i + 1) for i in range(len(segments))))


def chain(segments: list[int], sizes: list[int]) -> Fingerprint:
    """A real hash chain: each hash covers the whole prefix up to its segment."""
    hashes = tuple(hash(tuple(segments[: i + 1])) for i in range(len(segments)))
    tokens = tuple(sum(sizes[: i + 1]) for i in range(len(segments)))
    return Fingerprint(hashes, tokens)


segments = st.lists(st.integers(0, 2), min_size=1, max_size=8)


@given(segments, st.lists(segments, min_size=1, max_size=6), st.data())
def test_shared_segments_is_the_common_prefix_of_entries_the_prompt_shares_a_quarter_of(
    prompt: list[int], contents: list[list[int]], data: st.DataObject
) -> None:
    def sized(segs: list[int]) -> Fingerprint:
        sizes = data.draw(st.lists(st.integers(1, 50), min_size=len(segs), max_size=len(segs)))
        return chain(segs, sizes)

    request, entries = sized(prompt), [RamEntry(sized(c), 0.0) for c in contents]
    expected = []
    for entry in entries:
        n = common_segments(request.hashes, entry.content.hashes)
        expected.append(n if entry.content.tokens_at(n) >= 0.25 * entry.content.total else 0)
    assert ram_cache.shared_segments(request, entries) == tuple(expected)


def test_cache_is_consulted_only_for_a_non_empty_slot_keeping_less_than_half() -> None:
    assert ram_cache.consulted(kept=100, content_tokens=300, prompt_tokens=400)
    assert not ram_cache.consulted(kept=150, content_tokens=300, prompt_tokens=400)
    assert not ram_cache.consulted(kept=0, content_tokens=0, prompt_tokens=400)  # empty: NaN


def test_a_slot_sharing_a_tenth_of_the_prompt_or_less_is_consulted_whatever_it_keeps() -> None:
    """The server's pinned slot is "similar" only past ``--slot-prompt-similarity`` (0.1) of
    the prompt; otherwise its ``f_keep`` counts as 0 (real: 40 of a 440-token prompt kept 40
    of a 70-token slot, and the server loaded the prompt's session from its RAM cache)."""
    assert ram_cache.consulted(kept=40, content_tokens=70, prompt_tokens=440)
    assert ram_cache.consulted(kept=44, content_tokens=70, prompt_tokens=440)  # 0.1: not above
    assert not ram_cache.consulted(kept=45, content_tokens=70, prompt_tokens=440)
    assert not ram_cache.consulted(kept=40, content_tokens=70, prompt_tokens=440, share=0.4)


def test_an_entry_must_keep_a_quarter_of_itself_and_beat_the_slot_in_both_shares() -> None:
    header_only = [(100, 400)]  # serves 100 of the prompt, keeps 0.25 of itself
    assert ram_cache.pick(header_only, kept=0, content_tokens=300, prompt_tokens=400) == 0
    # the slot's own content keeps 100/300 > 0.25: the entry is not better, it stays parked
    assert ram_cache.pick(header_only, kept=100, content_tokens=300, prompt_tokens=400) is None
    assert ram_cache.pick([(90, 400)], kept=0, content_tokens=300, prompt_tokens=400) is None
    assert ram_cache.pick([(0, 0), (300, 400)], 0, 0, 400) == 1  # an empty slot: any entry


def test_save_skips_contained_content_drops_entries_it_contains_and_bounds_the_list() -> None:
    entries = ram_cache.save([], RamEntry(fp(1, 2), 1.0), limit=3)
    assert ram_cache.save(entries, RamEntry(fp(1), 2.0), limit=3) == entries  # already contained
    longer = ram_cache.save(entries, RamEntry(fp(1, 2, 3), 2.0), limit=3)
    assert [e.content for e in longer] == [fp(1, 2, 3)]  # the prefix entry is dropped
    full = longer
    for i in range(5):
        full = ram_cache.save(full, RamEntry(fp(10 + i), 3.0 + i), limit=3)
    assert [e.content for e in full] == [fp(12), fp(13), fp(14)]  # the oldest went


def test_a_loaded_entry_leaves_the_cache() -> None:
    a, b = RamEntry(fp(1, 2), 1.0), RamEntry(fp(1, 2), 2.0)
    assert ram_cache.without([a, b], a) == [b]
    assert ram_cache.drop_contained([a, RamEntry(fp(7), 3.0)], fp(1, 2, 3)) == [
        RamEntry(fp(7), 3.0)
    ]


def test_budget_skips_an_entry_larger_than_the_cache_and_evicts_the_oldest_to_fit() -> None:
    entries = ram_cache.save([], RamEntry(fp(1, 2), 1.0), limit=64, budget=500)  # 200 tokens
    assert ram_cache.save(entries, RamEntry(fp(5, 6, 7, 8, 9, 10), 2.0), 64, budget=500) == entries
    entries = ram_cache.save(entries, RamEntry(fp(3, 4, 5), 2.0), 64, budget=500)  # 300: fits
    assert [e.content for e in entries] == [fp(1, 2), fp(3, 4, 5)]
    entries = ram_cache.save(entries, RamEntry(fp(7), 3.0), limit=64, budget=500)
    assert [e.content for e in entries] == [fp(3, 4, 5), fp(7)]  # the oldest made room


def test_sizes_are_the_servers_tokens_when_known() -> None:
    # estimates 100 per segment; the server's real KV lengths are what its byte budget holds
    entries = ram_cache.save([], RamEntry(fp(1, 2), 1.0, size=600), limit=64, budget=1000)
    entries = ram_cache.save(entries, RamEntry(fp(3), 2.0, size=300), limit=64, budget=1000)
    assert [e.content for e in entries] == [fp(1, 2), fp(3)]  # 900 of 1000
    assert ram_cache.evicted_by(entries, RamEntry(fp(4), 3.0, size=200), budget=1000) == 1
    assert ram_cache.save(entries, RamEntry(fp(5), 3.0, size=1200), 64, budget=1000) == entries


def test_saving_the_pinned_slot_first_evicts_entries_it_then_cannot_load() -> None:
    entries = [RamEntry(fp(1, 2), 1.0), RamEntry(fp(3), 2.0)]  # 300 tokens held
    evicted = ram_cache.evicted_by
    assert evicted(entries, RamEntry(fp(7, 8), 0.0), budget=400) == 1  # fp(1, 2) makes room
    assert evicted(entries, RamEntry(fp(7, 8), 0.0), budget=None) == 0
    assert evicted(entries, RamEntry(fp(1), 0.0), budget=400) == 0  # already held: not saved
    assert evicted(entries, RamEntry(fp(7, 8, 9, 10, 11), 0.0), budget=400) == 0  # too large
    many = [RamEntry(fp(i), float(i)) for i in range(10, 20)]  # 1000 tokens held
    assert evicted(many, RamEntry(fp(1, 2, 3), 0.0), budget=1000) == 3  # the oldest three go


def test_an_entry_is_loadable_only_by_a_prompt_sharing_a_quarter_of_it() -> None:
    entry = RamEntry(fp(1, 2, 3, 4, 5, 6, 7, 8), 1.0)  # 800 tokens: a quarter is 2 segments
    assert ram_cache.shared_segments(fp(1, 2, 9), [entry]) == (2,)
    assert ram_cache.shared_segments(fp(1, 9, 9), [entry]) == (0,)  # 100 of 800: never loaded
    assert ram_cache.shared_segments(fp(1), [entry]) == (0,)  # shorter than the quarter
    assert ram_cache.shared_segments(fp(1, 2, 3, 4, 9), [entry]) == (4,)  # past the quarter
    assert ram_cache.shared_segments(fp(1, 2, 3, 4, 5, 6, 7, 8, 9), [entry]) == (8,)  # all of it
    served = [(100 * 2, 800)]
    assert ram_cache.pick(served, 0, 0, 300) == 0  # agrees with the server's own rule
    assert ram_cache.pick([(100, 800)], 0, 0, 300) is None


def test_a_park_that_changes_nothing_keeps_the_list_so_views_of_it_stay_valid() -> None:
    """A waiting request is decided again on every release; its RAM view of a backend is
    reused while the backend's list is the same object (``scoring.ram_view``)."""
    from proxy.core.routing.scoring import ram_view
    from proxy.core.server.fleet import BackendState

    a, b = RamEntry(fp(1, 2), 0.0), RamEntry(fp(3, 4), 0.0)
    entries = [a, b]
    assert ram_cache.park(entries, RamEntry(fp(1), 1.0), None, 8) is entries  # a holds it
    assert ram_cache.park(entries, None, fp(5), 8) is entries
    changed = ram_cache.park(entries, RamEntry(fp(6), 1.0), None, 8)
    assert changed is not entries
    assert changed[-1].content == fp(6)
    backend = BackendState(0, "b", ram_entries=entries)
    prompt = fp(1, 2, 9)
    view = ram_view(prompt, backend)
    assert view.best == 200
    assert ram_view(prompt, backend, view) is view
    backend.ram_entries = changed
    assert ram_view(prompt, backend, view) is not view


def test_a_views_memo_ends_when_the_backends_token_scale_moves() -> None:
    """A sealed entry's length goes through the backend's learned token scale, which moves
    with every response while the cache list may stay the same object."""
    from dataclasses import replace

    from proxy.core.routing.scoring import ram_view
    from proxy.core.server.fleet import BackendState

    sealed = replace(fp(1, 2), sealed=True)  # 200 estimated tokens, 800 real ones
    backend = BackendState(0, "b", ram_entries=[RamEntry(sealed, 0.0, 800)], token_scale=2.0)
    prompt = fp(1, 2, 9)
    view = ram_view(prompt, backend)
    assert view.served[0][1] == 400
    assert ram_view(prompt, backend, view) is view
    backend.token_scale = 4.0
    fresh = ram_view(prompt, backend, view)
    assert fresh is not view
    assert fresh.served[0][1] == 200


def test_an_exact_backends_entry_is_judged_on_its_real_length_too() -> None:
    """The server's quarter rule counts a raw prompt's whole KV, its reply included, on
    hybrid/recurrent/SWA backends (``exact``) as on the others."""
    from dataclasses import replace

    from proxy.core.routing.scoring import ram_view
    from proxy.core.server.fleet import BackendState

    sealed = replace(fp(1, 2), sealed=True)  # 200 estimated tokens, 1000 with its reply
    entry = RamEntry(sealed, 0.0, 1000)
    prompt = fp(1, 2, 9)  # extends the prompt exactly: 200 of 1000 kept, under a quarter
    for exact in (False, True):
        assert ram_view(prompt, BackendState(0, "b", exact=exact, ram_entries=[entry])).best == 0
    short = RamEntry(sealed, 0.0, 400)  # 200 of 400 kept: loaded
    for exact in (False, True):
        assert ram_view(prompt, BackendState(0, "b", exact=exact, ram_entries=[short])).best == 200


def test_an_entry_serving_as_far_as_the_slot_may_win_by_tokens_the_segments_do_not_show() -> None:
    """Entry and slot share the same segments with the prompt; the server compares exact
    tokens, where the entry may share a few more: with ``ties`` it counts as loaded."""
    entry = [(100, 300)]  # keeps a third of itself; the slot keeps a quarter of its content
    assert ram_cache.pick(entry, kept=100, content_tokens=400, prompt_tokens=400) is None
    assert ram_cache.pick(entry, kept=100, content_tokens=400, prompt_tokens=400, ties=True) == 0
    # a tie is only with the slot's own content: a later entry must still beat the first
    two = [(100, 300), (100, 200)]
    assert ram_cache.pick(two, kept=100, content_tokens=400, prompt_tokens=400, ties=True) == 0


def test_needs_park_where_the_server_will_not_bring_the_session_back() -> None:
    # a session: a 2,000-token system prompt, its own 500-token task (anchor) and a reply
    session = Fingerprint((1, 2, 3), (2000, 2500, 2600), anchor=2)
    other = Fingerprint((1, 7), (2000, 2400), anchor=2)  # another session: the header only
    stranger = Fingerprint((9,), (300,), anchor=1)  # keeps nothing: the server parks it in RAM
    onward = Fingerprint((1, 2, 3, 4), (2000, 2500, 2600, 2650), anchor=2)  # its next turn
    assert ram_cache.needs_park(session, other, 2600, ram=True)  # keeps 0.77: no RAM hook
    # ... unless the server's RAM cache will hold it where a primer brings it back
    assert not ram_cache.needs_park(session, other, 2600, ram=True, in_ram=True)
    assert ram_cache.needs_park(session, other, 2600, ram=True, always=True, in_ram=True)
    assert ram_cache.held([RamEntry(session, 0.0)], session)
    assert not ram_cache.held([RamEntry(other, 0.0)], session)
    assert not ram_cache.needs_park(session, stranger, 2600, ram=True)
    assert ram_cache.needs_park(session, stranger, 2600, ram=False)
    assert ram_cache.needs_park(session, stranger, 2600, ram=True, always=True)
    assert not ram_cache.needs_park(session, onward, 2600, ram=False, always=True)
    header = Fingerprint((1,), (2000,), anchor=2)  # a system prompt alone: kept whole
    assert not ram_cache.needs_park(header, other, 2000, ram=False, always=True)


def test_a_task_that_changes_nothing_in_the_ram_cache_keeps_its_list() -> None:
    """A task starting on a backend whose idle slots are all saved already (``--cache-idle-
    slots``), the claimed slot continuing its own content: the RAM cache is the same list
    after, so no idle slot is saved again and the requests' views of it stay valid."""
    f = fleet(8)
    for s in range(8):
        hold(f, 0, s, segments_fp(10 + s, 20))
    backend = f.backends[0]
    f.claim(Placement(0, (0,), 0), now=100.0, content=segments_fp(10, 20, 30))
    f.release(Placement(0, (0,), 0), now=101.0, clean=True, content=segments_fp(10, 20, 30, 40))
    cache = backend.ram_entries
    assert len(cache) == 7  # every other idle slot saved once
    f.claim(Placement(0, (0,), 0), now=102.0, content=segments_fp(10, 20, 30, 40, 50))
    assert backend.ram_entries is cache
    assert all(s.saved is not None and s.saved[1] is cache for s in backend.slots[1:])


def test_a_session_parting_in_the_system_prompts_last_line_keeps_the_slot_unparked() -> None:
    """Two agent sessions whose system prompts differ only in a last line: pinned to the
    other's slot, a prompt keeps nearly all of it, to the token, so the server's hook does not
    run and nothing is parked (by whole segments it kept the tools alone, and a park was
    predicted that the server did not make)."""
    from tests.unit.test_fingerprint import RULES, _agent

    slot, prompt = _agent(RULES + "\nsession=alpha"), _agent(RULES + "\nsession=beta")
    assert not ram_cache.hook_runs(slot, prompt)
    assert ram_cache.hook_runs(slot, _agent("Another agent. " + RULES))


def test_an_entry_parting_in_the_system_prompts_last_line_is_shared_to_the_token() -> None:
    """A session parked in RAM whose system prompt differs from the request's only in a last
    line: the server compares tokens, so the request keeps nearly all of the entry's system
    prompt and the entry is loaded; by whole segments it kept the tools alone, under a
    quarter, and was taken for one never loaded."""
    from tests.unit.test_fingerprint import RULES, _agent

    parked, request = _agent(RULES + "\nsession=alpha"), _agent(RULES + "\nsession=beta")
    entry = RamEntry(parked, 0.0)
    assert entry.quarter == 2
    assert common_segments(request.hashes, parked.hashes) == 1
    assert ram_cache.shared_segments(request, [entry]) == (1,)
    # a prompt parting early in the system prompt keeps under a quarter: never loaded
    assert ram_cache.shared_segments(_agent("Another agent. " + RULES), [entry]) == (0,)


def test_a_request_pinned_to_a_stranger_is_predicted_the_parked_entry_it_shares_in_part() -> None:
    """Pinned to a slot holding an unrelated prompt, the server loads the parked session that
    shares all of the request's system prompt but its last line: the prediction counts it."""
    from proxy.core.prompt.fingerprint import shared_tokens
    from proxy.core.routing.decision import route
    from tests.unit.test_fingerprint import RULES, _agent
    from tests.unit.test_routing import PARAMS, decided

    f = fleet(1)
    hold(f, 0, 0, _agent("An unrelated agent. " + RULES, "Other work."), at=90.0)
    parked, request = _agent(RULES + "\nsession=alpha"), _agent(RULES + "\nsession=beta")
    f.backends[0].ram_entries = [RamEntry(parked, 80.0)]
    d = decided(route(request, f.backends, PARAMS, now=100.0, allow_wait=False))
    assert d.placement is not None
    assert d.placement.from_ram == f.backends[0].ram_entries[0]
    assert d.predicted == shared_tokens(request, parked) > request.tokens[0]
