from __future__ import annotations

import pytest

from proxy.core.prompt.headers import (
    client_response_headers,
    header_text,
    presented_key,
    upstream_request_headers,
    with_credential,
)
from proxy.errors import InvalidRequest


def test_request_drops_hop_by_hop_connection_named_and_behaviour_changing() -> None:
    headers = [
        ("Host", "x"), ("Connection", "keep-alive, X-Secret"), ("X-Secret", "1"),
        ("Accept-Encoding", "gzip"), ("X-Conversation-Id", "c"), ("Content-Length", "3"),
        ("Authorization", "Bearer k"), ("Traceparent", "00-abc"),
    ]  # fmt: skip
    assert upstream_request_headers(headers) == [
        ("Authorization", "Bearer k"),
        ("Traceparent", "00-abc"),
    ]


def test_response_drops_framing() -> None:
    headers = [("Transfer-Encoding", "chunked"), ("Content-Type", "text/event-stream"),
               ("Content-Length", "9"), ("Server", "llama")]  # fmt: skip
    assert client_response_headers(headers) == [("Content-Type", "text/event-stream")]


def test_header_text_refuses_bytes_that_are_not_utf8() -> None:
    # aiohttp's decoding of the bytes b"\xff\xfe": two lone surrogates
    headers = {"X-Session-Id": b"\xff\xfe".decode("utf-8", "surrogateescape"), "X-Ok": "caf\u00e9"}
    with pytest.raises(InvalidRequest) as caught:
        header_text(headers, "X-Session-Id")
    assert (caught.value.status, caught.value.param) == (400, "X-Session-Id")
    assert header_text(headers, "X-Ok") == "caf\u00e9"
    assert header_text(headers, "X-Absent") == ""


def test_presented_key_as_llama_server_reads_it() -> None:
    assert presented_key({"Authorization": "Bearer k", "X-Api-Key": "x"}) == "k"
    assert presented_key({"Authorization": "k"}) == "k"
    assert presented_key({"X-Api-Key": "x"}) == "x"
    assert presented_key({}) == ""


def test_with_credential_replaces_the_clients_key_only_when_the_backend_has_one() -> None:
    headers = [("Authorization", "Bearer client"), ("x-api-key", "client"), ("Accept", "*/*")]
    assert with_credential(headers, None) == headers
    assert with_credential(headers, "b") == [("Accept", "*/*"), ("Authorization", "Bearer b")]
