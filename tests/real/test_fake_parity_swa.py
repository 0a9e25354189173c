"""The fake's sliding-window mode reuses what the real server reuses, on Gemma 3 270M.

One request sequence on slot 0, against llama-server on Gemma 3 (``n_swa`` 512) with and
without ``--swa-full``, and against the fake with ``Memory(kind=SWA, n_swa=512)``, both
without the RAM prompt cache (``--cache-ram 0``), so that each step meets the slot's own
memory. The fake counts words as tokens, so the test compares the *kind* of each step's
``cache_n``, computed on each server's own tokens: ``none`` (0), ``prefix`` (the whole
common prefix with the prompt the slot holds, at most the prompt less one token),
``checkpoint`` (one less than the start of a user message within that prefix: a checkpoint
taken there, restored one token short) or anything else (which fails the comparison). The
texts are lowercase words without punctuation, about one token a word on both, so the
windows line up.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from proxy.core.server.ram_cache import PRIMER
from testbed.fake_llama import FakeLlamaServer, render_chat, tokenize
from testbed.fake_memory import SWA, Memory

SYSTEM = "you keep the harbor log tidy and note every ship that docks " * 25  # ~300 tokens
FIRST = " and tell me about the ships in the harbor today" * 60  # ~600 tokens


def _history(name: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"session {name}{FIRST}"},
    ]


def _turn(messages: list[dict[str, str]], reply: str, ask: str) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": ask}]


A, B, C = _history("alpha"), _history("beta"), [{"role": "user", "content": "tides and moons"}]
A2 = _turn(A, "the alba came first", "which came last")
A3 = _turn(A2, "zebra quartz", "and which is largest")  # not what the model says
STEPS: list[tuple[str, list[dict[str, str]] | str]] = [
    ("A cold", A),
    ("A's next turn", A2),
    ("B: same system prompt, another first message", B),
    ("A's turn again (the slot holds B)", A2),
    ("save", "save"),
    ("C overwrites the slot", C),
    ("restore", "restore"),
    ("A's next turn on the restored slot (an exact extension)", A3),
    ("restore", "restore"),
    ("B on the restored slot (diverges far behind its end)", B),
]


class Tokens:
    """A server's tokens of a chat prompt, and where its user messages start."""

    def __init__(self, url: str, session: aiohttp.ClientSession, fake: bool) -> None:
        self.url, self.session, self.fake = url, session, fake

    async def __call__(self, messages: list[dict[str, str]]) -> tuple[list[str], list[int]]:
        if self.fake:
            pieces = tokenize(render_chat({"messages": messages}))
        else:
            async with self.session.post(
                self.url + "/apply-template", json={"messages": messages}
            ) as resp:
                text = (await resp.json())["prompt"]
            body = {"content": text, "add_special": True, "with_pieces": True}
            async with self.session.post(self.url + "/tokenize", json=body) as resp:
                pieces = [str(t["piece"]) for t in (await resp.json())["tokens"]]
        starts, offset, at = [], 0, {}
        for i, piece in enumerate(pieces):
            at[offset] = i
            offset += len(piece)
        text = "".join(pieces)
        for pos in range(len(text)):
            if text.startswith("<|im_start|>user", pos) and pos in at:
                starts.append(at[pos])
        return pieces, starts


def _lcp(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _kind(cache_n: int, lcp: int, n_prompt: int, users: list[int]) -> str:
    if cache_n == 0:
        return "none"
    if cache_n == min(lcp, n_prompt - 1):
        return "prefix"
    if any(cache_n == u - 1 for u in users if u <= lcp):
        return "checkpoint"
    return f"other ({cache_n} of {n_prompt}, common prefix {lcp}, user starts {users})"


async def _sequence(url: str, fake: bool) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    held: list[str] = []  # the prompt whose KV the slot holds
    saved: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        tokens = Tokens(url, session, fake)
        for name, step in STEPS:
            if isinstance(step, str):
                path = f"/slots/0?action={step}"
                async with session.post(url + path, json={"filename": "swa.bin"}) as resp:
                    assert resp.status == 200, await resp.text()
                saved, held = (held, held) if step == "save" else (saved, saved)
                continue
            body = {"messages": step, "max_tokens": 3, "temperature": 0, "id_slot": 0}
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                reply = await resp.json()
            pieces, users = await tokens(step)
            assert reply["usage"]["prompt_tokens"] == len(pieces), name
            cache_n = reply["timings"]["cache_n"]
            seen.append((name, _kind(cache_n, _lcp(held, pieces), len(pieces), users)))
            held = pieces
    return seen


@pytest.mark.parametrize("swa_full", [False, True])
async def test_fake_swa_mode_reuses_what_gemma_reuses(gemma_servers: Any, swa_full: bool) -> None:
    real = gemma_servers(swa_full=swa_full, ctx_per_slot=4096, extra=("--cache-ram", "0"))
    expected = await _sequence(real.url, fake=False)
    save_dir = real.save_dir / "fake"
    save_dir.mkdir()
    memory = Memory(kind=SWA, n_swa=512, swa_full=swa_full)
    fake = FakeLlamaServer(memory=memory, ram_cache=False, save_dir=save_dir)
    await fake.start()
    try:
        assert await _sequence(fake.url, fake=True) == expected
    finally:
        await fake.stop()
    kinds = [kind for _, kind in expected]
    window = "prefix" if swa_full else "checkpoint"  # B and A again: behind the window
    live = "prefix" if swa_full else "none"  # C shares two tokens, within no checkpoint
    # a restored slot: an exact extension is reused only with --swa-full; a prompt diverging
    # more than n_swa tokens before its end is not reused even then (its SWA layers were
    # saved for the last n_swa positions only)
    assert kinds == ["none", "prefix", window, window, live, live, "none"]


PRIMED_SYSTEM = SYSTEM * 3  # ~900 tokens: most of each session, as in agent fleets


async def _primed_sequence(url: str, fake: bool) -> list[str]:
    """Two slots, the RAM cache on: A on slot 0; an unrelated task on slot 1 (slot 0 is
    saved to RAM as it starts); B, sharing the system prompt, on slot 0 (it keeps over half of
    A: no RAM hook); the primer on slot 0; A's next turn on slot 0. The kinds of the chat
    steps' ``cache_n``; for A's return, ``end`` when it is the checkpoint 4 tokens before the
    end of A's previous prompt, restored one token short (what a RAM load brings back on a
    sliding-window model without ``--swa-full``)."""
    a = [{"role": "system", "content": PRIMED_SYSTEM}, {"role": "user", "content": "session alpha"}]
    b = [{"role": "system", "content": PRIMED_SYSTEM}, {"role": "user", "content": "session beta"}]
    kinds: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        tokens = Tokens(url, session, fake)

        async def chat(messages: list[dict[str, str]], slot: int) -> tuple[int, str]:
            body = {"messages": messages, "max_tokens": 3, "temperature": 0, "id_slot": slot}
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                reply = await resp.json()
            return reply["timings"]["cache_n"], reply["choices"][0]["message"]["content"]

        async def raw(prompt: str, slot: int, n_predict: int) -> None:
            body = {"prompt": prompt, "n_predict": n_predict, "id_slot": slot}
            async with session.post(url + "/completion", json=body) as resp:
                assert resp.status == 200, await resp.text()

        held, users = await tokens(a)
        cache_n, reply = await chat(a, 0)
        kinds.append(_kind(cache_n, 0, len(held), users))
        await raw("tides and moons over the quiet bay", 1, 3)
        pieces, users = await tokens(b)
        cache_n, _ = await chat(b, 0)
        kinds.append(_kind(cache_n, _lcp(held, pieces), len(pieces), users))
        await raw(PRIMER, 0, 0)
        again = _turn(a, reply, "which came last")
        pieces, users = await tokens(again)
        cache_n, _ = await chat(again, 0)
        end = cache_n == len(held) - 5
        kinds.append("end" if end else _kind(cache_n, _lcp(held, pieces), len(pieces), users))
    return kinds


async def test_fake_swa_mode_loads_a_primed_session_as_gemma_does(gemma_servers: Any) -> None:
    real = gemma_servers(slots=2, ctx_per_slot=4096)  # without --swa-full, the RAM cache on
    expected = await _primed_sequence(real.url, fake=False)
    memory = Memory(kind=SWA, n_swa=512, swa_full=False)
    fake = FakeLlamaServer(n_slots=2, memory=memory)
    await fake.start()
    try:
        assert await _primed_sequence(fake.url, fake=True) == expected
    finally:
        await fake.stop()
    # B diverges from A within the last n_ubatch tokens: reused up to there
    assert expected == ["none", "prefix", "end"]
