"""Agent sessions sharing one long system prompt, as the real-server tests and benchmarks send
them: each session's turn is its previous messages, the previous reply as returned and a new
short user message, and sessions are interleaved (s0t0 s1t0 s2t0 s0t1 ...)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

RULES = " ".join(
    f"Rule {i}: before you change module {i}, read its tests, keep the change small, "
    f"explain it in one line and run the checks for area {i % 7}."
    for i in range(61)
)
SYSTEM = "You are a coding agent working in a large repository. " + RULES
ASKS = ["List the first step.", "Why?", "And then?", "Summarise."]


def task(session: int) -> str:
    """A session's own opening: a bug report with its log (about 400 tokens)."""
    log = " ".join(
        f"step {i}: parser {session} read token {i * 7 + session} at line {i * 13 + session}."
        for i in range(24)
    )
    return f"Session {session}: fix bug {session * 17} in parser {session}. Log: {log}"


@dataclass(frozen=True)
class Turn:
    session: int
    turn: int
    cached: int  # timings.cache_n
    prompt: int  # cache_n + prompt_n: the whole prompt in the server's tokens
    completion: int
    predicted: int | None  # X-Cache-Predicted-Tokens (None: straight to the server)


Send = Callable[[int, dict[str, Any]], Awaitable[tuple[dict[str, Any], Any]]]


async def run_agents(send: Send, sessions: int, turns: int = 4) -> list[Turn]:
    histories = {
        s: [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task(s)},
        ]
        for s in range(sessions)
    }
    out = []
    for t in range(turns):
        for s in range(sessions):
            body = {"messages": histories[s], "max_tokens": 8, "temperature": 0}
            answer, headers = await send(s, body)
            timings = answer["timings"]
            predicted = headers.get("X-Cache-Predicted-Tokens")
            out.append(
                Turn(
                    s,
                    t,
                    timings["cache_n"],
                    timings["cache_n"] + timings["prompt_n"],
                    answer["usage"]["completion_tokens"],
                    None if predicted is None else int(predicted),
                )
            )
            reply = answer["choices"][0]["message"]["content"]
            histories[s] = [
                *histories[s],
                {"role": "assistant", "content": reply},
                {"role": "user", "content": ASKS[(t + s) % len(ASKS)]},
            ]
    return out
