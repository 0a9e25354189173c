from __future__ import annotations

import json

import pytest

from proxy.core.request.body import parse_body, pin_body
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
        (b'{"messages": {}}', "invalid_type"),
        (b'{"messages": [{"role": "u"}], "n": "2"}', "invalid_type"),
        (b'{"messages": [{"role": "u"}], "max_tokens": "x"}', "invalid_type"),
        (b'{"messages": [{"role": "u"}], "n_cmpl": 0}', "invalid_value"),
    ],
)
def test_parse_rejects_with_a_code(raw: bytes, code: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_body(raw, chat=True)
    assert info.value.code == code
    assert info.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "raw",
    [
        rb'{"messages": [{"role": "user", "content": "\ud800"}]}',  # a high half alone
        rb'{"messages": [{"role": "user", "content": "x\uDC00y"}]}',  # a low half alone
        rb'{"messages": [{"role": "user", "content": "\udc00\ud800"}]}',  # in the wrong order
        rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}',
        rb'{"messages": [{"role": "user", "content": "x"}], "\ud800": 1}',  # in a key
    ],
)
def test_a_lone_surrogate_is_rejected_as_llama_server_does(raw: bytes) -> None:
    """Python's decoder accepts what UTF-8 cannot encode; llama-server answers it 400."""
    with pytest.raises(InvalidRequest) as info:
        parse_body(raw, chat=True)
    assert info.value.code == "invalid_json"
    assert "surrogate" in info.value.body()["error"]["message"]


def test_paired_surrogates_and_an_escaped_backslash_are_text() -> None:
    raw = rb'{"messages": [{"role": "user", "content": "\ud83d\ude00 \\ud800"}]}'
    parsed = parse_body(raw, chat=True)
    assert parsed.data["messages"][0]["content"] == "\U0001f600 \\ud800"


@pytest.mark.parametrize(
    ("raw", "reads"),
    [
        (b'{"messages": [], "prompt": true}', {"chat": True}),  # a chat reads no prompt
        (b'{"input": "x", "prompt": 1}', {}),  # nor does a response
        (b'{"input": "x", "stream": "no", "n": 0, "prompt": 5}', {"generates": False}),
        (b'{"content": "x", "max_tokens": "x", "cache_prompt": 1}', {"generates": False}),
    ],
    ids=["chat", "responses", "embeddings", "embeddings-counts"],
)
def test_a_field_the_route_does_not_read_passes_whatever_it_holds(
    raw: bytes, reads: dict[str, bool]
) -> None:
    """As it does directly: llama-server reads no ``prompt`` on a chat, and none of a
    completion's fields on an embedding (its answer is 200)."""
    parsed = parse_body(raw, **reads)
    assert (parsed.stream, parsed.completions) == (False, 1)
    with pytest.raises(InvalidRequest):  # where the server reads it, it is checked
        parse_body(b'{"prompt": 3}', prompt=True)


def test_a_nul_byte_ends_the_body_as_it_ends_llama_servers_input() -> None:
    """What follows the NUL is ignored, as llama-server's parser ignores it; the two fields
    the proxy sets go inside the object the server reads."""
    parsed = parse_body(b'{"prompt": "x"}\0trailing}', prompt=True)
    assert parsed.data == {"prompt": "x"}
    assert pin_body(parsed.data, 1, True, parsed.source) == (
        b'{"prompt": "x","id_slot":1,"cache_prompt":true}'
    )
    with pytest.raises(InvalidRequest):  # in a string: the string is cut, as the server's
        parse_body(b'{"prompt": "x\0y"}', prompt=True)


def test_pin_body_sets_only_owned_fields() -> None:
    data = {"prompt": "x", "id_slot": 9, "z": "é"}
    assert json.loads(pin_body(data, 1)) == {
        "prompt": "x",
        "id_slot": 1,
        "cache_prompt": True,
        "z": "é",
    }
    assert json.loads(pin_body(data, None)) == {"prompt": "x", "cache_prompt": True, "z": "é"}
    assert json.loads(pin_body(data, 1, reuse=False))["cache_prompt"] is False
    assert data["id_slot"] == 9  # the client's dict is not modified


def test_the_clients_bytes_go_as_they_came_with_the_two_fields_after_them() -> None:
    """No re-encoding: number spellings, key order and spacing are the client's (and a large
    body is not encoded again); a body that names either field, or the proxy's own
    ``prefix_cache``, is written anew."""
    raw = rb'{"prompt": "x", "temperature": 1e-7, "z": "\u00e9"}' + b"  \n"
    parsed = parse_body(raw, chat=False)
    forwarded = pin_body(parsed.data, 3, True, parsed.source)
    assert (
        forwarded
        == rb'{"prompt": "x", "temperature": 1e-7, "z": "\u00e9","id_slot":3,"cache_prompt":true}'
    )
    assert json.loads(forwarded) == {**parsed.data, "id_slot": 3, "cache_prompt": True}
    empty = parse_body(b"{}", chat=False)
    assert pin_body(empty.data, None, False, empty.source) == b'{"cache_prompt":false}'
    for named in (b'{"prompt": "x", "id_slot": 1}', b'{"prompt": "x", "cache_prompt": false}'):
        parsed = parse_body(named, chat=False)
        assert json.loads(pin_body(parsed.data, 0, True, parsed.source))["id_slot"] == 0
    scoped = parse_body(b'{"prompt": "x", "prefix_cache": {"scope": "off"}}', chat=False)
    assert scoped.source is None
    assert b"prefix_cache" not in pin_body(scoped.data, 0, True, scoped.source)


def test_a_clients_cache_prompt_false_is_kept() -> None:
    """A run that reuses nothing (reused KV may not reproduce it bit for bit)."""
    data = {"prompt": "x", "cache_prompt": False}
    assert json.loads(pin_body(data, 1))["cache_prompt"] is False
    assert json.loads(pin_body({**data, "cache_prompt": True}, 1))["cache_prompt"] is True


@pytest.mark.parametrize(
    "raw",
    [
        b'\xef\xbb\xbf{"prompt": "x"}',  # a byte order mark first
        b'{"prompt": "x", "stream": null, "cache_prompt": null}',  # a null is absent
        b'{"prompt": "x", "n_predict": 1.0, "id_slot": 1.0, "n": 1.0}',  # whole numbers
        b'{"prompt": "x", "n_predict": 1.7}',  # (the server reads its integer part)
        b'{"prompt": "x", "n_predict": true, "n": true}',  # a boolean counts as 0 or 1
        b'{"prompt": "x", "id_slot": "x"}',  # not a number: the server's default, any slot
        b'{"prompt": "x", "model": 5}',  # (the server reads no model but in router mode)
    ],
    ids=["bom", "nulls", "whole-floats", "fraction", "booleans", "id-slot-text", "model"],
)
def test_what_llama_server_accepts_the_proxy_accepts(raw: bytes) -> None:
    parsed = parse_body(raw, chat=False)
    assert parsed.data["prompt"] == "x"
    assert parsed.stream is False
    assert parsed.client_id_slot in (None, 1)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "x", "temperature": NaN}',
        b'{"prompt": "x", "temperature": Infinity}',
        b'{"prompt": "x", "temperature": 1e400}',
        b'{"prompt": "x", "cache_prompt": 0}',
    ],
    ids=["nan", "infinity", "overflow", "cache-prompt-not-bool"],
)
def test_what_llama_server_refuses_is_refused_before_it_is_re_encoded(raw: bytes) -> None:
    """Python's decoder reads ``NaN`` and turns ``1e400`` into infinity; re-encoded, the
    server would get a body the client did not send."""
    with pytest.raises(InvalidRequest):
        parse_body(raw, chat=False)


def test_prefix_cache_is_parsed_and_stripped() -> None:
    parsed = parse_body(
        b'{"prompt": "x", "prefix_cache": {"scope": "auto:8"}, "temperature": 0}', chat=False
    )
    assert str(parsed.prefix_cache) == "auto:8"
    assert "prefix_cache" not in parsed.data
    assert b"prefix_cache" not in pin_body(parsed.data, 0)
    windowed = parse_body(b'{"prompt": "x", "prefix_cache": {"window": 4}}', chat=False)
    assert str(windowed.prefix_cache) == "auto:4"
    fixed = parse_body(b'{"prompt": "x", "prefix_cache": {"scope": "1000"}}', chat=False)
    assert str(fixed.prefix_cache) == "1000"
    assert parse_body(b'{"prompt": "x"}', chat=False).prefix_cache is None


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ('{"scope": "sometimes"}', "prefix_cache.scope"),
        ('{"scope": "auto:0"}', "prefix_cache.scope"),
        ('{"scope": 5}', "prefix_cache.scope"),
        ('{"window": 0}', "prefix_cache.window"),
        ('{"window": "8"}', "prefix_cache.window"),
        ('{"other": 1}', "prefix_cache"),
        ('"auto"', "prefix_cache"),
    ],
)
def test_bad_prefix_cache_is_a_400_naming_the_field(value: str, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_body(f'{{"prompt": "x", "prefix_cache": {value}}}'.encode(), prompt=True)
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("prompt", "tasks"),
    [
        ("text", 1),
        ([1, 2, 3], 1),
        (["text", 12, 13], 1),  # mixed: one prompt
        (["only"], 1),
        (["a", "b"], 2),
        ([[1, 2], [3, 4], [5]], 3),
        ([{"prompt_string": "a"}, "b"], 2),
        ([True, "b"], 2),  # a boolean is not a token id
        ([], 1),  # the server refuses it: one request, no pin to fear
    ],
)
def test_a_prompt_array_without_token_ids_is_a_batch(prompt: object, tasks: int) -> None:
    raw = json.dumps({"prompt": prompt}).encode()
    assert parse_body(raw, chat=False, batches=True).tasks == tasks
    assert parse_body(raw, chat=False).tasks == 1  # endpoints that take no batch


@pytest.mark.parametrize(
    ("body", "completions"),
    [
        ({"n": 2}, 2),
        ({"n_cmpl": 3, "n": 2}, 3),
        ({"n_cmpl": None, "n": 2}, 2),  # null is absent to the server: n counts
        ({"n_cmpl": 2, "n": None}, 2),
        ({"n": None}, 1),
        ({}, 1),
    ],
)
def test_completions_read_as_the_server_reads_them(
    body: dict[str, object], completions: int
) -> None:
    raw = json.dumps({"prompt": "x", **body}).encode()
    assert parse_body(raw, chat=False).completions == completions
