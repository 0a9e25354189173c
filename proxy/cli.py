"""Command line: ``llama-cache-proxy serve`` (and ``report``).

Flags, ``LLAMA_CACHE_PROXY_*`` environment variables and a YAML/TOML config file all feed the
one settings tree (``proxy.config.settings``); a bad value prints one line naming the field and the
process exits with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy import __version__
from proxy.app import create_app
from proxy.config.settings import Settings, load_settings
from proxy.config.sources import ConfigError
from proxy.http.middleware import JsonLogFormatter

# on SIGTERM or SIGINT a request in flight may still end within twice this (aiohttp waits
# once, cancels its body, waits again), then its handler is cancelled and its backend
# connection closed, so llama-server cancels the task: a proxy stops about as promptly as
# the llama-server it stands in for, which stops at once
STOP_GRACE_SECONDS = 0.25


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llama-cache-proxy")
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument(
        "--backend",
        action="append",
        dest="backends",
        metavar="URL",
        help="llama-server base URL; repeat for several",
    )
    serve.add_argument(
        "--listen", help="host:port (default 127.0.0.1:8000); hosts comma-separated: a,b:port"
    )
    serve.add_argument("--redis-url", help="shared state in Redis; omit for embedded state")
    serve.add_argument("--config", type=Path, help="YAML, TOML or JSON config file")
    serve.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    serve.add_argument("--log-format", choices=["text", "json"], help="json: one object a line")
    serve.add_argument("--admin-token", help="bearer token for /admin/*; none = admin off")
    serve.add_argument(
        "--api-key", metavar="KEYS", help="clients' keys, comma-separated, as llama-server's"
    )
    serve.add_argument("--tokenizer", choices=["tiktoken", "backend"])
    serve.add_argument(
        "--disk-prefix-cache", metavar="SCOPE", help="off | full | auto | auto:N | N (default auto)"
    )
    serve.add_argument("--kv-cache-min-tokens", type=int, metavar="TOKENS")
    serve.add_argument("--disk-cache-max-bytes", type=int, metavar="BYTES")
    serve.add_argument(
        "--slot-save-dir", metavar="PATH", help="the --slot-save-path all backends share"
    )
    serve.add_argument("--cache-isolation", choices=["off", "tenant"])
    serve.add_argument("--tenant-header", metavar="NAME", help="default: the bearer API key")
    report = sub.add_parser(
        "report", help="where sessions' prompts churn (reads a running proxy's /admin/churn)"
    )
    report.add_argument("--url", default="http://127.0.0.1:8000", help="the proxy")
    report.add_argument(
        "--admin-token", default=os.environ.get("LLAMA_CACHE_PROXY_ADMIN_TOKEN"), help="bearer"
    )
    return parser


def settings_from_args(args: argparse.Namespace, environ: dict[str, str]) -> Settings:
    routing = {"tokenizer": args.tokenizer}
    disk = {
        "prefix_cache": args.disk_prefix_cache,
        "min_tokens": args.kv_cache_min_tokens,
        "max_bytes": args.disk_cache_max_bytes,
        "slot_save_dir": args.slot_save_dir,
    }
    cli: dict[str, Any] = {
        "backends": args.backends,
        "listen": args.listen,
        "redis_url": args.redis_url,
        "log_level": args.log_level,
        "log_format": args.log_format,
        "admin_token": args.admin_token,
        "api_key": args.api_key,
        "routing": {k: v for k, v in routing.items() if v is not None} or None,
        "disk": {k: v for k, v in disk.items() if v is not None} or None,
        "isolation": {
            k: v
            for k, v in (("mode", args.cache_isolation), ("tenant_header", args.tenant_header))
            if v is not None
        }
        or None,
    }
    return load_settings(cli=cli, environ=environ, config_file=args.config)


def _configure_logging(level: str, form: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if form == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


def event_loop() -> asyncio.AbstractEventLoop:
    """The loop ``serve`` runs on: uvloop where it is installed (a dependency except on
    Windows), whose C loop and transports cost a relay less per request than asyncio's own;
    asyncio's loop otherwise. The proxy's code is the same on both."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "report":
        from proxy.report import run_report

        return run_report(args.url, args.admin_token)
    try:
        settings = settings_from_args(args, dict(os.environ))
    except ConfigError as exc:
        print(f"llama-cache-proxy: {exc}", file=sys.stderr)
        return 2
    _configure_logging(settings.log_level, settings.log_format)
    logging.getLogger(__name__).info(
        "listening on %s, backends=%s, state=%s",
        settings.listen,
        ",".join(b.base_url for b in settings.backends),
        "redis" if settings.redis_url else "embedded",
    )
    try:
        web.run_app(
            create_app(settings),
            host=list(settings.hosts),
            port=settings.port,
            handler_cancellation=True,
            shutdown_timeout=STOP_GRACE_SECONDS,
            access_log=None,
            print=None,
            loop=event_loop(),
        )
    except OSError as exc:  # (the port in use, a host that is not this machine's)
        reason = exc.strerror or str(exc)
        print(f"llama-cache-proxy: cannot listen on {settings.listen}: {reason}", file=sys.stderr)
        return 2
    return 0
