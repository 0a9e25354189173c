"""pytest plugin for llama.cpp's own server tests (``tools/server/tests``): SmolLM2, and the proxy.

``scripts/conformance`` runs that suite from its directory with ``-p llama_suite`` twice: once
against llama-server directly, once with ``--conformance-via proxy``. The plugin wraps the
suite's ``ServerProcess.start``/``stop`` (its ``utils.py``):

- the model: every preset the suite would download from the network is either redirected to
  the local SmolLM2 GGUF (presets that only need "a model") or the test is skipped with the
  reason (embedding, rerank, multimodal, draft and LoRA files, and test-specific models);
- ``proxy``: llama-server starts on a free port exactly as the suite starts it, then
  ``python -m proxy serve --backend ...`` listens on the port the suite's clients use, so every
  request of the test goes through the proxy. A ``--api-key`` of the server is the proxy's key
  and the backend's key too (the proxy is then the only port a client needs); ``--kv-unified``
  is the backend's ``kv_unified`` (llama-server does not report it).

Each test's outcome (and the first line of its failure) goes to ``--conformance-out`` as JSON
lines; ``compare.py`` beside this file turns the two runs into the table and failure list.
The module is a plugin, not a test module: the project's own pytest run never collects it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

# Presets (by Hugging Face repo) that stand for "a small text model": SmolLM2 replaces them.
REDIRECTED = {
    "ggml-org/models:tinyllamas/stories260K.gguf",
    "ggml-org/test-model-stories260K",
    "ggml-org/test-model-stories260K-infill",
    "ggml-org/stories15M_MOE:stories15M_MOE-F16.gguf",
}
PROXY_READY_SECONDS = 30.0
_OUT = [""]  # the --conformance-out path


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance")
    group.addoption("--conformance-via", choices=["direct", "proxy"], default="direct")
    group.addoption("--conformance-model", required=True, help="the GGUF that replaces presets")
    group.addoption("--conformance-out", required=True, help="JSON lines: one outcome a test")
    group.addoption("--conformance-repo", required=True, help="the proxy's checkout")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _preset_model(server: Any) -> str | None:
    """The downloaded model a server would load, as ``repo[:file]``; None when local."""
    if server.model_file or not (server.model_hf_repo or server.model_url):
        return None
    if server.model_url:
        return str(server.model_url)
    file = f":{server.model_hf_file}" if server.model_hf_file else ""
    return f"{server.model_hf_repo}{file}"


def _use_local_model(server: Any, model: str) -> None:
    wanted = _preset_model(server)
    if wanted is not None and wanted not in REDIRECTED:
        pytest.skip(f"needs model {wanted}")
    if server.mmproj_url or server.model_draft or server.lora_files:
        pytest.skip("needs a multimodal projector, draft model or LoRA file")
    if wanted is not None:
        server.model_file, server.model_hf_repo, server.model_hf_file = model, None, None
    server.offline = True


class _Proxy:
    """``llama-cache-proxy serve`` in front of one started llama-server, in its own process.

    The process is forked from this one with the proxy already imported, then runs the
    command line's ``main(["serve"])``, configured by ``LLAMA_CACHE_PROXY_*`` variables (a
    fresh interpreter would spend seconds importing the proxy for every test).
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.proc: multiprocessing.process.BaseProcess | None = None

    def start(
        self, host: str, port: int, backend_port: int, api_key: str | None, unified: bool
    ) -> None:
        backend: dict[str, Any] = {"url": f"http://127.0.0.1:{backend_port}", "kv_unified": unified}
        env = {
            "LLAMA_CACHE_PROXY_LOG_LEVEL": "WARNING",
            "LLAMA_CACHE_PROXY_LISTEN": f"{host}:{port}",
        }
        if api_key:
            backend["api_key"] = api_key
            env["LLAMA_CACHE_PROXY_API_KEY"] = api_key
        env["LLAMA_CACHE_PROXY_BACKENDS"] = json.dumps([backend])
        test = os.environ.get("PYTEST_CURRENT_TEST", "test").split(" ")[0]
        log = self.log_dir / (test.replace("/", "_").replace("::", "__")[:180] + ".log")
        self.proc = multiprocessing.get_context("fork").Process(target=_serve, args=(env, log))
        self.proc.start()
        first = host.split(",")[0].strip()
        self._wait_ready(f"http://{first}:{port}/readyz")

    def _wait_ready(self, url: str) -> None:
        deadline = time.monotonic() + PROXY_READY_SECONDS
        while time.monotonic() < deadline:
            assert self.proc is not None
            if not self.proc.is_alive():
                raise RuntimeError(f"proxy exited with {self.proc.exitcode}")
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"proxy not ready ({url}) within {PROXY_READY_SECONDS}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)
        self.proc = None


def _serve(env: dict[str, str], log: Path) -> None:
    """The forked proxy process: output to ``log``, then the command line's ``serve``."""
    from proxy.cli import main

    with open(log, "ab") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(env)
    os._exit(main(["serve"]))


def _wrap_server(utils: Any, config: pytest.Config) -> None:
    model = config.getoption("--conformance-model")
    via_proxy = config.getoption("--conformance-via") == "proxy"
    if via_proxy:  # imported once here, so that each forked proxy starts at once
        sys.path.insert(0, config.getoption("--conformance-repo"))
        import proxy.cli  # noqa: F401
    log_dir = Path(config.getoption("--conformance-out")).with_suffix(".logs")
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    original_start, original_stop = utils.ServerProcess.start, utils.ServerProcess.stop

    def start(self: Any, *args: Any, **kwargs: Any) -> None:
        _use_local_model(self, model)
        if not via_proxy:
            original_start(self, *args, **kwargs)
            return
        front = self.server_port
        self.server_port = _free_port()
        try:
            original_start(self, *args, **kwargs)
        finally:
            backend_port, self.server_port = self.server_port, front
        self._conformance_proxy = _Proxy(log_dir)
        unified = bool(self.kv_unified)  # configured as an operator would (the server's flag)
        self._conformance_proxy.start(self.server_host, front, backend_port, self.api_key, unified)

    def stop(self: Any) -> None:
        proxy = getattr(self, "_conformance_proxy", None)
        if proxy is not None:
            proxy.stop()
        original_stop(self)

    utils.ServerProcess.start, utils.ServerProcess.stop = start, stop


def _no_downloads(utils: Any) -> None:
    def download_file(url: str, output_file_path: str | None = None) -> str:
        pytest.skip(f"needs a downloaded file: {url}")

    utils.download_file = download_file
    utils.ServerPreset.load_all = staticmethod(lambda: None)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if str(config.rootpath) not in sys.path:
        sys.path.insert(0, str(config.rootpath))
    os.environ.setdefault("PORT", str(_free_port()))
    # this build's CPU repack kernels crash on SmolLM2's Q4_1 on some CPUs (as tests/real do)
    os.environ.setdefault("LLAMA_ARG_REPACK", "0")
    # one thread: two threads that spin-wait on a busy 2-core machine generate far slower
    os.environ.setdefault("LLAMA_ARG_THREADS", "1")
    import utils  # the suite's own module (its conftest imports it too)

    _no_downloads(utils)
    _wrap_server(utils, config)
    _OUT[0] = config.getoption("--conformance-out")
    Path(_OUT[0]).write_text("")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and not (report.failed or report.skipped):
        return
    cause = ""
    if report.failed:
        cause = _one_line(report)
    elif report.skipped and isinstance(report.longrepr, tuple):
        cause = str(report.longrepr[2]).removeprefix("Skipped: ")
    outcome = "error" if report.failed and report.when != "call" else report.outcome
    line = {
        "test": report.nodeid,
        "outcome": outcome,
        "cause": cause,
        "s": round(report.duration, 2),
    }
    with open(_OUT[0], "a") as fh:
        fh.write(json.dumps(line) + "\n")


def _one_line(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return " ".join(text.split())[:300]
