from __future__ import annotations

import json
from dataclasses import replace

import pytest

from proxy.core.disk.snapshots import (
    BackendDisk,
    Layout,
    Offer,
    Snapshot,
    Stray,
    belongs,
    evictions,
    file_name,
    index_key,
    lookup_keys,
    offers,
    pack_entries,
    restore_failed,
    stray_evictions,
    unpack_entries,
    valid_name,
)
from proxy.core.routing.decision import Reason, route
from proxy.core.server.fleet import Placement
from tests.unit.test_routing import PARAMS, decided, fleet, fp, hold

LAYOUT = Layout("/m/smol.gguf", "Q4_1", 2048, 2, False)


def snap(chain: int, segments: int, *, directory: str = "dir:/s", **over: object) -> Snapshot:
    base = Snapshot(
        name=file_name(LAYOUT, chain),
        directory=directory,
        chain=chain,
        segments=segments,
        tokens=segments * 100,
        estimate=segments * 100,
        nbytes=1000 * segments,
        layout=LAYOUT,
        created=0.0,
        last_used=0.0,
    )
    return replace(base, **over)  # type: ignore[arg-type]


def disk(index: int, layout: Layout | None = LAYOUT, directory: str = "dir:/s") -> BackendDisk:
    return BackendDisk(index, directory, layout, prefill_tps=1000.0, restore_bps=1e6)


def test_layout_refusals_name_what_differs() -> None:
    assert LAYOUT.refusal(LAYOUT) is None
    assert LAYOUT.refusal(replace(LAYOUT, slots=3)) == "slots"
    assert LAYOUT.refusal(replace(LAYOUT, n_ctx=4096)) == "n_ctx"
    assert LAYOUT.refusal(replace(LAYOUT, model="/m/other.gguf")) == "model"
    assert LAYOUT.refusal(replace(LAYOUT, unified=True)) == "unified"
    assert LAYOUT.refusal(replace(LAYOUT, unified=None)) is None  # unknown: not refused


def test_layout_from_props() -> None:
    props = {
        "model_path": "/m/smol.gguf",
        "model_ftype": "Q4_1",
        "total_slots": 2,
        "default_generation_settings": {"n_ctx": 2048},
    }
    assert Layout.from_props(props, False) == LAYOUT


def test_file_names_are_hashes_and_differ_by_prefix_and_layout() -> None:
    name = file_name(LAYOUT, 7)
    assert name.startswith("llp-")
    assert name.endswith(".bin")
    assert all(c in "0123456789abcdef" for c in name[4:-4])
    assert file_name(LAYOUT, 8) != name
    assert file_name(replace(LAYOUT, slots=3), 7) != name
    assert index_key(LAYOUT.model_id, 7) != index_key(replace(LAYOUT, ftype="F16").model_id, 7)


def test_entries_roundtrip() -> None:
    entries = [snap(1, 1), snap(2, 2, bad=True)]
    assert unpack_entries(pack_entries(entries)) == entries
    assert unpack_entries(None) == []


@pytest.mark.parametrize(
    "name",
    [
        "/etc/passwd",
        "../x",
        "llp-zz.bin",
        "/tmp/victim/llp-" + "0" * 32 + ".bin",
        "../llp-" + "0" * 32 + ".bin",
        "llp-" + "A" * 32 + ".bin",
        "llp-" + "0" * 31 + ".bin",
        "llp-" + "0" * 32 + ".bin\n",
        "llp-" + "0" * 32 + ".bin/..",
        "",
        5,
        None,
    ],
)
def test_only_names_the_proxy_makes_are_valid(name: object) -> None:
    assert not valid_name(name)
    entry = {**snap(1, 1).pack(), "name": name}
    assert unpack_entries(json.dumps([entry, snap(2, 2).pack()])) == [snap(2, 2)]


def test_an_entry_naming_another_layouts_file_is_dropped() -> None:
    """A store writer relabels a snapshot of model A as model B's (same shape): its file was
    saved by A, and B's server would restore it without a word. The name no longer is the one
    the proxy makes for the layout, so the entry is dropped."""
    other = Layout("/m/other.gguf", "Q4_1", 2048, 2, False)
    relabelled = {**snap(1, 1).pack(), "layout": other.__dict__}
    chain_moved = {**snap(1, 1).pack(), "chain": 2}
    assert unpack_entries(json.dumps([relabelled, chain_moved, snap(3, 3).pack()])) == [snap(3, 3)]


def test_a_lookup_keeps_only_its_models_entries_for_its_prefix() -> None:
    entry = snap(7, 2, aliases=(5,))
    assert belongs(entry, LAYOUT.model_id, 7)
    assert belongs(entry, LAYOUT.model_id, 5)
    assert not belongs(entry, LAYOUT.model_id, 6)  # filed under another prefix's key
    other = Layout("/m/other.gguf", "Q4_1", 2048, 2, False)
    assert not belongs(entry, other.model_id, 7)  # filed under another model's key


def test_generated_names_are_valid() -> None:
    assert valid_name(file_name(LAYOUT, 7))
    assert valid_name(snap(3, 3).name)


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b'{"name": "x"}',
        b"[1, null, []]",
        json.dumps([{**snap(1, 1).pack(), "extra": 1}]),
        json.dumps([{k: v for k, v in snap(1, 1).pack().items() if k != "layout"}]),
        json.dumps([{**snap(1, 1).pack(), "layout": "x"}]),
        json.dumps([{**snap(1, 1).pack(), "nbytes": "9"}]),
        json.dumps([{**snap(1, 1).pack(), "nbytes": -1}]),
        json.dumps([{**snap(1, 1).pack(), "directory": 3}]),
        json.dumps([{**snap(1, 1).pack(), "aliases": 3}]),
        json.dumps([{**snap(1, 1).pack(), "aliases": ["x"]}]),
        json.dumps([{**snap(1, 1).pack(), "last_used": "now"}]),
        json.dumps([{**snap(1, 1).pack(), "bad": "no"}]),
        json.dumps([{**snap(1, 1).pack(), "layout": {**LAYOUT.__dict__, "n_ctx": True}}]),
        json.dumps([{**snap(1, 1).pack(), "layout": {**LAYOUT.__dict__, "unified": 1}}]),
        pytest.param(b"[" * 100_000, id="nested-too-deep"),
    ],
)
def test_malformed_stored_entries_are_dropped(raw: bytes | str) -> None:
    assert unpack_entries(raw) == []


def test_strays_count_toward_the_budget_and_go_first_oldest_first() -> None:
    indexed = [snap(1, 1), snap(2, 2)]  # 3000 bytes
    strays = [Stray("b", 1000, 20.0), Stray("a", 1000, 10.0), Stray("c", 1000, 30.0)]
    assert stray_evictions(indexed, strays, 6000) == []
    assert [s.name for s in stray_evictions(indexed, strays, 5000)] == ["a"]
    assert [s.name for s in stray_evictions(indexed, strays, 1000)] == ["a", "b", "c"]
    assert stray_evictions(indexed, [], 1000) == []  # the index's own: ``evictions``


def test_lookup_keys_skip_small_prefixes() -> None:
    request = fp(11, 12, 13)
    keys = lookup_keys(request, "m", 150)
    assert [segments for segments, _ in keys] == [2, 3]


def test_lookup_keys_stop_at_prefixes_no_slot_holds() -> None:
    request = fp(11, 12, 13)
    tokens = request.tokens
    keys = lookup_keys(request, "m", 1, tokens[1])
    assert [segments for segments, _ in keys] == [1, 2]


def test_offers_take_the_longest_compatible_snapshot_per_backend() -> None:
    request = fp(1, 2, 3, 4)
    found = {
        2: [snap(2, 2)],
        3: [snap(3, 3, layout=replace(LAYOUT, slots=3))],  # saved by a -np 3 server
        4: [snap(4, 4, bad=True)],
    }
    lookup = offers(request, found, [disk(0), disk(1, directory="backend:b1")])
    assert set(lookup.offers) == {0}  # backend 1 does not share the directory
    assert lookup.offers[0].snapshot.segments == 2
    assert lookup.offers[0].reuse == 200
    assert lookup.offers[0].cost == 2000 / 1e6 * 1000  # restore seconds x prefill tokens/s
    assert lookup.refused == 1


def test_restore_failure_and_lru_evictions() -> None:
    assert restore_failed(500, 3, 900)
    assert not restore_failed(500, 499, 900)
    assert not restore_failed(0, 0, 900)
    entries = [snap(1, 1, last_used=5.0), snap(2, 2, last_used=1.0), snap(3, 3, last_used=9.0)]
    assert [e.chain for e in evictions(entries, 6000)] == []
    assert [e.chain for e in evictions(entries, 4000)] == [2]
    assert [e.chain for e in evictions(entries, 3000)] == [2, 1]
    bad = [snap(1, 1, last_used=5.0), snap(2, 1, last_used=9.0, bad=True)]
    assert [e.chain for e in evictions(bad, 1000)] == [2]  # bad files go first


def offer(tokens: int, cost: float = 1.0) -> Offer:
    return Offer(snap(2, 2), tokens, cost, 2)


def test_a_cold_request_restores_a_shared_prefix_into_an_empty_slot() -> None:
    f = fleet(2)
    d = decided(route(fp(1, 2, 3), f.backends, PARAMS, now=100.0, disk={0: offer(200)}))
    assert d.reason is Reason.DISK
    assert d.restore is not None
    assert d.predicted == 200


def test_fan_out_restores_instead_of_stealing_a_warm_session() -> None:
    f = fleet(2)
    hold(f, 0, 0, fp(1, 2, 7, 8, 9, 10), at=99.0)  # another session, warm, shares 1,2
    request = fp(1, 2, 3)
    without = decided(route(request, f.backends, PARAMS, now=100.0))
    assert without.placement == Placement(0, (1,), 1)  # cold, re-prefills the shared part
    with_disk = decided(route(request, f.backends, PARAMS, now=100.0, disk={0: offer(200)}))
    assert with_disk.placement == Placement(0, (1,), 1)
    assert with_disk.restore is not None  # the shared prefix comes from disk


def test_live_reuse_beats_a_shorter_or_costlier_snapshot() -> None:
    f = fleet(2)
    hold(f, 0, 1, fp(1, 2, 3))
    request = fp(1, 2, 3, 4)
    d = decided(route(request, f.backends, PARAMS, now=100.0, disk={0: offer(200)}))
    assert d.restore is None
    assert d.placement == Placement(0, (1,), 1)
    costly = decided(route(request, f.backends, PARAMS, now=100.0, disk={0: offer(350, 500.0)}))
    assert costly.restore is None


def test_props_that_contradict_the_recommended_flags_are_named() -> None:
    from proxy.backends.health import flag_warnings

    assert flag_warnings({"endpoint_slots": True, "endpoint_metrics": True}) == []
    warnings = flag_warnings({"endpoint_slots": False, "endpoint_metrics": False})
    assert any("--no-slots" in w for w in warnings)
    assert any("--metrics" in w for w in warnings)
