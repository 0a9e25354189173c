"""Every route llama-server b11434 registers (tools/server/server.cpp) is forwarded, answered
by the proxy, or refused on purpose."""

from __future__ import annotations

from proxy.upstream import HEALTH, REFUSED, ROUTES, SlotUse

LLAMA_SERVER_ROUTES = [
    ("GET", "/health"), ("GET", "/v1/health"), ("GET", "/metrics"), ("GET", "/props"),
    ("POST", "/props"), ("GET", "/models"), ("GET", "/v1/models"), ("POST", "/completion"),
    ("POST", "/completions"), ("POST", "/v1/completions"), ("POST", "/chat/completions"),
    ("POST", "/v1/chat/completions"), ("POST", "/v1/chat/completions/control"),
    ("POST", "/v1/responses"), ("POST", "/responses"), ("POST", "/v1/audio/transcriptions"),
    ("POST", "/audio/transcriptions"), ("POST", "/v1/messages"), ("POST", "/infill"),
    ("POST", "/embedding"), ("POST", "/embeddings"), ("POST", "/v1/embeddings"),
    ("POST", "/rerank"), ("POST", "/reranking"), ("POST", "/v1/rerank"),
    ("POST", "/v1/reranking"), ("POST", "/v1/systemone"), ("POST", "/tokenize"),
    ("POST", "/detokenize"), ("POST", "/apply-template"),
    ("POST", "/chat/completions/input_tokens"), ("POST", "/v1/chat/completions/input_tokens"),
    ("POST", "/responses/input_tokens"), ("POST", "/v1/responses/input_tokens"),
    ("POST", "/v1/messages/count_tokens"), ("GET", "/lora-adapters"),
    ("POST", "/lora-adapters"), ("GET", "/slots"), ("POST", "/slots/{id_slot}"),
    ("GET", "/v1/stream"), ("POST", "/v1/streams/lookup"), ("DELETE", "/v1/stream"),
    ("GET", "/cors-proxy"), ("POST", "/cors-proxy"), ("GET", "/tools"), ("POST", "/tools"),
]  # fmt: skip
# the proxy's own /metrics takes the path; multipart audio is not forwarded (README)
NOT_FORWARDED = {
    ("GET", "/metrics"),
    ("POST", "/v1/audio/transcriptions"),
    ("POST", "/audio/transcriptions"),
}


def test_every_llama_server_route_is_served_or_refused() -> None:
    for method, path in LLAMA_SERVER_ROUTES:
        forwarded = path in ROUTES and method in ROUTES[path].methods
        answered = method == "GET" and path in HEALTH
        handled = forwarded or answered or (method, path) in REFUSED
        assert handled != ((method, path) in NOT_FORWARDED), (method, path)


def test_tasks_on_a_slot_the_server_picks_need_a_whole_backend() -> None:
    for path in ("/embedding", "/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        assert ROUTES[path].slot_use is SlotUse.EXCLUSIVE
    for path in ("/v1/messages/count_tokens", "/tools", "/cors-proxy", "/lora-adapters"):
        assert ROUTES[path].slot_use is SlotUse.NONE
