from __future__ import annotations

from proxy.core.headers import client_response_headers, upstream_request_headers


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
