"""The fake's sliding-window and recurrent reuse rules, against what llama-server logged.

The numbers come from a run of llama-server on Gemma 3 270M (``n_swa`` 512, ``-ub 512``,
``-np 2``, SWA ring of 1024 cells): its ``created context checkpoint`` lines give each
checkpoint's ``n_tokens`` and ``pos_min``, and its responses the ``cache_n``.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from testbed import fake_memory
from testbed.fake_llama import FakeLlamaServer, render_chat, tokenize
from testbed.fake_memory import RECURRENT, SWA, Memory, SlotMemory

GEMMA = Memory(kind=SWA, n_swa=512)


def _run(
    mem: Memory, state: SlotMemory, cached: int, lcp: int, n_prompt: int, users: list[int]
) -> int:
    """One request on a slot holding ``cached`` tokens; its ``cache_n``."""
    state.sync(mem, cached)
    n_past = fake_memory.reuse(mem, state, lcp, n_prompt)
    kept = min(n_past, n_prompt - 1)
    fake_memory.prefill(mem, state, kept, n_prompt, users, task=n_prompt)
    return kept


def _cps(state: SlotMemory) -> list[tuple[int, int]]:
    return [(c.n_tokens, c.pos_min) for c in state.checkpoints]


def test_checkpoints_and_reuse_follow_the_real_servers_log() -> None:
    state = SlotMemory()
    # A cold: 1779 tokens, user messages at 1705 and 1752 (after the system prompt)
    assert _run(GEMMA, state, 0, 0, 1779, [1705, 1752]) == 0
    assert _cps(state) == [(1263, 239), (1705, 681), (1752, 728), (1775, 751)]
    # A's next turn (an exact extension of A's prompt; 4 tokens generated, 3 in the KV)
    assert _run(GEMMA, state, 1782, 1779, 1815, [1705, 1752, 1788]) == 1779
    assert _cps(state)[-3:] == [(1779, 758), (1788, 764), (1811, 787)]
    # B: same history, another last user message; divergence within the window: no checkpoint
    assert _run(GEMMA, state, 1818, 1762, 1782, [1705, 1752]) == 1762
    assert _cps(state) == [(1263, 239), (1705, 681), (1752, 728), (1762, 794), (1778, 794)]


def test_a_divergence_behind_the_window_needs_a_checkpoint() -> None:
    state = SlotMemory()
    _run(GEMMA, state, 0, 0, 1779, [1705, 1752])
    # shares 1265 tokens: pos_min 758 >= 1265 - 512, so the newest checkpoint at or
    # before 1265 (n_tokens 1263) serves it, one token short (SWA); 1200: none does
    assert _run(GEMMA, state, 1782, 1265, 1779, [1705, 1752]) == 1262
    state = SlotMemory()
    _run(GEMMA, state, 0, 0, 1779, [1705, 1752])
    assert _run(GEMMA, state, 1782, 1200, 1779, [1705, 1752]) == 0
    # with --swa-full the window holds everything: all 1500
    full = Memory(kind=SWA, n_swa=512, swa_full=True)
    dense_like = SlotMemory()
    _run(full, dense_like, 0, 0, 1779, [1705, 1752])
    assert dense_like.checkpoints == []
    assert _run(full, dense_like, 1782, 1200, 1779, [1705, 1752]) == 1200


def test_a_restored_swa_slot_is_reused_only_with_swa_full_and_a_late_divergence() -> None:
    state = SlotMemory()
    state.restored(GEMMA, 1818, checkpoints=False)
    assert _run(GEMMA, state, 1818, 1762, 1782, [1705, 1752]) == 0
    full = Memory(kind=SWA, n_swa=512, swa_full=True)
    for lcp, kept in ((1762, 1762), (1818, 1818), (1200, 0)):  # 1818 - 512 = 1306
        state = SlotMemory()
        state.restored(full, 1818, checkpoints=False)
        assert _run(full, state, 1818, lcp, 1900, []) == kept


def test_recurrent_memory_reuses_a_strict_extension_or_a_checkpoint() -> None:
    mem = Memory(kind=RECURRENT)
    state = SlotMemory()
    _run(mem, state, 0, 0, 100, [60])
    assert _cps(state) == [(60, 59), (96, 95)]
    assert _run(mem, state, 103, 103, 120, []) == 103  # exact strict extension
    state = SlotMemory()
    _run(mem, state, 0, 0, 100, [60])
    assert _run(mem, state, 103, 80, 120, []) == 60  # diverged: back to the checkpoint
    state = SlotMemory()
    _run(mem, state, 0, 0, 100, [60])
    assert _run(mem, state, 103, 100, 100, []) == 96  # an exact repeat needs one too
    assert _run(Memory(), SlotMemory(), 103, 80, 120, []) == 80  # dense: any prefix


def test_checkpoints_are_bounded_per_slot() -> None:
    mem = Memory(kind=RECURRENT, ctx_checkpoints=3)
    state = SlotMemory()
    _run(mem, state, 0, 0, 100, [20, 40, 60, 80])
    assert len(state.checkpoints) == 3
    assert [c.n_tokens for c in state.checkpoints] == [40, 80, 96]


async def _chat(url: str, body: dict[str, Any]) -> dict[str, Any]:
    path = url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as session, session.post(path, json=body) as resp:
        return dict(await resp.json())


async def test_the_fake_in_swa_mode_serves_the_appendix_sequence(tmp_path: Any) -> None:
    """Through HTTP: a live slot reuses an exact extension and, past the window, the
    checkpoint at the last user message; a slot restored from a file reuses nothing."""
    system = {"role": "system", "content": "Keep the harbor log tidy. " * 300}
    history = [
        system,
        {"role": "user", "content": "List the ships."},
        {"role": "assistant", "content": "Alba and Brig."},
    ]
    fake = FakeLlamaServer(
        memory=Memory(kind=SWA, n_swa=32, n_ubatch=32, cells=64), save_dir=tmp_path
    )
    url = await fake.start()
    try:

        def body(messages: list[dict[str, str]]) -> dict[str, Any]:
            return {"messages": messages, "max_tokens": 4, "id_slot": 0}

        a = [*history, {"role": "user", "content": "Which came first? " * 40}]
        b = [*history, {"role": "user", "content": "Which is largest? " * 40}]
        cold = await _chat(url, body(a))
        n_a = cold["usage"]["prompt_tokens"]
        turn = [{"role": "assistant", "content": "Alba."}, {"role": "user", "content": "More."}]
        ext = await _chat(url, body([*a, *turn]))
        # A's prompt but its closing newline (a word token here: "\nAlba." in the next turn)
        assert ext["timings"]["cache_n"] == n_a - 1
        other = await _chat(url, body(b))
        last_user = fake_memory.user_starts(tokenize(render_chat({"messages": b})))[-1]
        assert other["timings"]["cache_n"] == last_user - 1  # the checkpoint, one short
        await _post(url + "/slots/0?action=save", {"filename": "b.bin"})
        await _chat(url, body([{"role": "user", "content": "Tides."}]))
        await _post(url + "/slots/0?action=restore", {"filename": "b.bin"})
        again = await _chat(url, body(b))
        assert again["timings"]["cache_n"] == 0
    finally:
        await fake.stop()


async def _post(url: str, body: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
