from __future__ import annotations

import json

import pytest

from proxy.core.request_body import parse_body, pin_body
from proxy.errors import InvalidRequest


def test_parse_reads_routing_fields_and_keeps_body() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": True, "n": 2})
    parsed = parse_body(raw.encode(), chat=True)
    assert parsed.stream is True
    assert parsed.completions == 2
    assert parsed.client_id_slot is None
    assert parsed.data == json.loads(raw)


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"", "empty_body"),
        (b"\xff", "invalid_encoding"),
        (b"{", "invalid_json"),
        (b'"x"', "invalid_json"),
        (b'{"messages": []}', "invalid_type"),
        (b'{"messages": [{"role": "u"}], "id_slot": "1"}', "invalid_type"),
        (b'{"messages": [{"role": "u"}], "n": true}', "invalid_type"),
        (b'{"messages": [{"role": "u"}], "model": 3}', "invalid_type"),
        (b'{"messages": [{"role": "u"}], "prompt": 3}', "invalid_type"),
        (b'{"messages": [{"role": "u"}], "n_cmpl": 0}', "invalid_value"),
    ],
)
def test_parse_rejects_with_a_code(raw: bytes, code: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_body(raw, chat=True)
    assert info.value.code == code
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_pin_body_sets_only_owned_fields() -> None:
    data = {"prompt": "x", "id_slot": 9, "cache_prompt": False, "z": "é"}
    assert json.loads(pin_body(data, 1)) == {
        "prompt": "x",
        "id_slot": 1,
        "cache_prompt": True,
        "z": "é",
    }
    assert json.loads(pin_body(data, None)) == {"prompt": "x", "cache_prompt": True, "z": "é"}
    assert data["id_slot"] == 9  # the client's dict is not modified
