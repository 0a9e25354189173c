from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.real.stack import LlamaServer, require_real_stack


@pytest.fixture
def llama_servers() -> Iterator[Callable[..., LlamaServer]]:
    """``llama_servers(slots=2)`` starts a real llama-server; all are stopped at teardown."""
    binary, model = require_real_stack()
    started: list[LlamaServer] = []

    def start(**kwargs: Any) -> LlamaServer:
        server = LlamaServer(binary, model, **kwargs).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.cleanup()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/real/" in str(item.fspath):
            item.add_marker(pytest.mark.real)
