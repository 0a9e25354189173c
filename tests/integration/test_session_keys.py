"""Session keys from the headers agents send by default (routing's ``cache_key_sources``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import chat

SYSTEM = "You are a coding agent. " * 30


@pytest.mark.parametrize(
    "header",
    ["X-Session-Id", "session_id", "x-session-affinity", "x-claude-code-session-id"],
)
async def test_a_session_header_drives_affinity(fakes: Any, proxy: Any, header: str) -> None:
    client = await proxy([await fakes(n_slots=2)])
    routes = []
    for turn in range(3):
        body = {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Open the README."},
                {"role": "user", "content": f"turn {turn}"},
            ],
            "max_tokens": 8,
        }
        answer = await client.post("/v1/chat/completions", json=body, headers={header: "s-42"})
        assert answer.status == 200
        routes.append((answer.headers["X-Cache-Route"], answer.headers["X-Cache-Slot"]))
    assert [route for route, _ in routes[1:]] == ["affinity", "affinity"]
    assert len({slot for _, slot in routes}) == 1


async def test_a_header_key_outranks_the_user_field(fakes: Any, proxy: Any) -> None:
    client = await proxy([await fakes(n_slots=2)])
    key = {"session_id": "s-1"}
    await client.post(
        "/v1/chat/completions", json=chat(SYSTEM, max_tokens=8, user="a"), headers=key
    )
    body = chat(SYSTEM, max_tokens=8, user="b")  # keyed by "b" were the user field first
    again = await client.post("/v1/chat/completions", json=body, headers=key)
    assert again.headers["X-Cache-Route"] == "affinity"
