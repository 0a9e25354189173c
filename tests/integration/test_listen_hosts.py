"""``listen`` with several hosts, as llama-server's ``--host 127.0.0.1,::1``: one port on each."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from proxy.config.settings import load_settings
from testbed.stack import free_port


def _answers(url: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                return int(resp.status)
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"{url} never answered (exit status {proc.poll()})")


def test_listen_splits_comma_separated_hosts() -> None:
    cli = {"backends": ["http://a:1"], "listen": "127.0.0.1, ::1:8000"}
    settings = load_settings(cli=cli, environ={})
    assert settings.hosts == ("127.0.0.1", "::1")
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)


def test_serve_listens_on_each_host() -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    port = free_port()
    args = ["serve", "--listen", f"127.0.0.1,::1:{port}", "--backend", "http://127.0.0.1:9"]
    proc = subprocess.Popen([sys.executable, "-m", "proxy", *args], stderr=subprocess.DEVNULL)
    try:
        assert _answers(f"http://127.0.0.1:{port}/healthz", proc) == 200
        assert _answers(f"http://[::1]:{port}/healthz", proc) == 200
    finally:
        proc.terminate()
        proc.wait(10)
