"""The settings tree's sections (the root, ``Settings``, and loading live in
``proxy.config.settings``).

Each section is frozen and forbids unknown keys; every tunable names its unit and reason.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, SecretStr, field_validator

from proxy.core.disk.scope import parse_scope
from proxy.core.replicas.auth import PRIVATE
from proxy.core.routing.scoring import RoutingParams


class _Frozen(BaseModel):
    # (an infinite or NaN number of seconds, tokens or bytes is never a setting that works)
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def unset_if_empty(value: Any) -> Any:
    """An empty string is no value: ``${VAR:-}`` in a compose file or an empty environment
    variable leaves an optional setting unset (an empty admin token turned admin on, with a
    token no client could present)."""
    return None if value == "" else value


class BackendSettings(_Frozen):
    """One llama-server instance."""

    url: AnyHttpUrl
    name: str | None = Field(
        default=None, description="label in metrics and logs; default host:port"
    )
    kv_reuse: Literal["auto", "prefix", "exact"] = Field(
        default="auto",
        description="how the server reuses a slot's KV. auto: probed once per start (two "
        "short prompts on one idle slot); prefix: up to any divergence (dense, or --swa-full); "
        "exact: only at checkpoints or as an exact extension (SWA, hybrid, recurrent)",
    )
    ram_cache: bool = Field(True, description="backend keeps llama-server's RAM prompt cache on")
    ram_cache_tokens: int | None = Field(
        None, ge=1, description="tokens it holds: --cache-ram MiB / KV bytes per token"
    )
    cache_idle_slots: bool = Field(
        True,
        description="started with --cache-idle-slots (its default); false: --no-cache-idle-slots",
    )
    slot_save_dir: str | None = Field(
        default=None,
        description="its --slot-save-path as the proxy sees it (default: disk.slot_save_dir)",
    )
    kv_unified: bool | None = Field(
        default=None,
        description="started with unified KV (-kvu): recorded with snapshots, and idle slots "
        "saved to RAM as a task starts are then cleared (llama-server does not report it)",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="its --api-key: sent on the proxy's own calls and, in place of the "
        "client's key, on every forwarded request; none: clients' keys pass through",
    )

    @field_validator("url")
    @classmethod
    def _plain_url(cls, url: AnyHttpUrl) -> AnyHttpUrl:
        if url.username or url.password:  # (it would be logged, and is never sent)
            raise ValueError("holds a user or password: give the server's key as api_key")
        if url.query or url.fragment:
            raise ValueError("holds a query or fragment: the base URL of a llama-server")
        if (url.path or "").rstrip("/").endswith("/v1"):  # an OpenAI client's base URL
            raise ValueError(
                "ends in /v1: give the llama-server's own base URL (clients' paths, /v1/... "
                "included, are forwarded as they come)"
            )
        return url

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return f"{self.url.host}:{self.url.port}"

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")

    @property
    def key(self) -> str | None:
        """Its API key, or None."""
        return None if self.api_key is None else self.api_key.get_secret_value()


class QueueSettings(_Frozen):
    """Requests wait here when every slot is busy."""

    max_waiting: int = Field(default=256, ge=0, description="queued requests before 503")
    # as long as a backend may stay silent (``timeouts.read_seconds``): llama-server queues a
    # request for a slot without a bound, and a client that waits for it directly would not
    # get a 503 sooner (a shorter bound answers 503 to a turn the server would have run, and a
    # client that retries it may send it changed)
    max_wait_seconds: float = Field(default=600.0, gt=0, description="wait before 503")
    retry_after_seconds: int = Field(default=2, ge=1, description="Retry-After on a 503")


class TimeoutSettings(_Frozen):
    connect_seconds: float = Field(default=5.0, gt=0)
    read_seconds: float = Field(
        default=600.0, gt=0, description="max silence from a backend before 504 / stream error"
    )
    probe_seconds: float = Field(
        default=2.0,
        gt=0,
        description="timeout of one health probe, token count or read of a backend's /metrics",
    )
    client_body_seconds: float = Field(
        default=30.0, gt=0, description="a client's upload must arrive within this (slow loris)"
    )


class HealthSettings(_Frozen):
    interval_seconds: float = Field(default=2.0, gt=0, description="backend probe period")
    drain_poll_seconds: float = Field(
        default=0.1,
        gt=0,
        description="first poll of /slots after an abort (a stream's task ends at once), then "
        "the least period: polls are also 1.25 s apart, or llama-server never checks the "
        "closed connection of a request still waiting for its answer",
    )
    drain_max_seconds: float = Field(
        default=10.0, gt=0, description="give up waiting for an aborted slot after this"
    )


class RoutingSettings(_Frozen):
    """Prefix-aware routing (algorithm: proxy/core/routing/decision.py)."""

    prefix_aware: bool = Field(default=True, description="false: least-busy backend, LRU slot")
    pin_slots: bool = Field(
        default=True,
        description="send id_slot; false: choose the backend, let llama-server choose the slot",
    )
    honor_client_id_slot: bool = Field(
        default=False, description="pin to the id_slot a client sends instead of choosing"
    )
    route_headers: bool = Field(
        default=True, description="add X-Cache-Route, -Predicted-Tokens, -Slot and Server-Timing"
    )
    address_headers: bool = Field(
        default=False,
        description="with route_headers, also X-Cache-Backend and X-Cache-Replica: internal "
        "addresses and replica ids, for tests and debugging; off: not shown to clients",
    )
    tokenizer: Literal["tiktoken", "backend"] = "tiktoken"
    block_tokens: int = Field(default=16, ge=4, description="raw-prompt fingerprint block size")
    min_prefix_tokens: int = Field(default=16, ge=0)
    wait_min_tokens: int = Field(default=1024, ge=0, description="saving worth waiting for")
    wait_min_fraction: float = Field(default=0.5, ge=0, le=1, description="...or this share")
    max_slot_wait_seconds: float = Field(
        default=5.0,
        ge=0,
        description="the longest a request is kept from a slot: waiting for a busy one, or "
        "held off one kept for its session's next turn; 0: neither",
    )
    value_half_life_seconds: float = Field(default=600.0, gt=0)
    cache_key_sources: tuple[str, ...] = Field(
        default=(
            "prompt_cache_key",
            "header:x-session-id",
            "header:session_id",
            "header:x-session-affinity",
            "header:x-claude-code-session-id",
            "user",
        ),
        description="where a session key comes from, first found wins (body fields, or "
        "header:NAME; OpenClaw sends session_id and x-session-affinity, Claude Code "
        "x-claude-code-session-id)",
    )
    affinity_ttl_seconds: float = Field(default=3600.0, gt=0)
    lease_ttl_seconds: float = Field(
        default=30.0, ge=1, description="a dead replica's slot leases expire after this"
    )

    @field_validator("cache_key_sources", mode="before")
    @classmethod
    def _sources(cls, value: Any) -> Any:
        """From the environment: ``a,header:b`` or a JSON list, as the other list settings."""
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                return json.loads(value)
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    def params(self) -> RoutingParams:
        """The pure policy's parameters (``core.routing.scoring.RoutingParams``)."""
        return RoutingParams(
            min_prefix_tokens=self.min_prefix_tokens,
            wait_min_tokens=self.wait_min_tokens,
            wait_min_fraction=self.wait_min_fraction,
            value_half_life_s=self.value_half_life_seconds,
        )


class DiskSettings(_Frozen):
    """The disk tier of KV snapshots (algorithms: proxy/core/disk/scope.py, snapshots.py)."""

    prefix_cache: str = Field(
        default="auto",
        validate_default=True,
        description="scope: off | full | auto (= auto:30) | auto:N | N tokens",
    )
    min_tokens: int = Field(default=256, ge=1, description="smallest prefix worth a snapshot")
    max_bytes: int = Field(
        default=20 * 1024**3, ge=0, description="budget per save directory; LRU evicted"
    )
    slot_save_dir: str | None = Field(
        default=None,
        description="the --slot-save-path every backend shares, as the proxy sees it",
    )
    _slot_save_dir = field_validator("slot_save_dir", mode="before")(unset_if_empty)
    park: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="save a warm session before evicting it; auto: where the server will "
        "not bring it back itself: without llama-server's host-RAM prompt cache, or when the "
        "evicting request keeps at least half of the slot (agents sharing a system prompt: "
        "the server then neither parks nor loads it); on: also where the server parks it",
    )
    park_min_tokens: int = Field(default=1024, ge=1, description="smallest session parked")
    client_max_bytes: int = Field(
        default=0,
        ge=0,
        description="bytes of snapshots one client's requests may write per "
        "client_window_seconds (client: its API key or tenant header); over it a save is "
        "skipped, the request served; bounds what one client costs the disk; 0 = no cap",
    )
    client_window_seconds: float = Field(
        default=3600.0, gt=0, description="seconds of the sliding window of client_max_bytes"
    )
    reconcile_seconds: float = Field(
        default=300.0,
        ge=0,
        description="seconds between scans of the save directory for llp-*.bin files the "
        "index lost (counted in the budget, deleted first); also at start-up; 0 = start-up only",
    )

    @field_validator("prefix_cache", "park", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        if isinstance(value, bool):  # YAML reads a bare on / off as a boolean
            return "on" if value else "off"
        return value

    @field_validator("prefix_cache")
    @classmethod
    def _scope(cls, value: str) -> str:
        return str(parse_scope(value))


class IsolationSettings(_Frozen):
    """Tenant cache isolation (algorithm: proxy/core/prompt/isolation.py)."""

    mode: Literal["off", "tenant"] = Field(
        default="off", description="tenant: never reuse another tenant's cached prefix"
    )
    tenant_header: str | None = Field(
        default=None, description="header naming the tenant; default: the bearer API key"
    )

    _tenant_header = field_validator("tenant_header", mode="before")(unset_if_empty)

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare off as false


MIN_SECRET = 16  # characters of replicas.secret: an empty or short key signs for anyone


def _origin_host(url: str) -> str | None:
    """The host of an origin URL whose port (if any) is a port; None otherwise."""
    try:
        parts = urlsplit(url)
        return None if parts.port == 0 else parts.hostname
    except ValueError:
        return None


class ReplicaSettings(_Frozen):
    """How replicas sharing a store trust each other (algorithm: proxy/core/replicas/auth.py)."""

    secret: SecretStr | None = Field(
        default=None,
        description="shared by every replica: signs heartbeats and forwarded requests; at "
        f"least {MIN_SECRET} characters (a short key is guessed: openssl rand -hex 32); "
        "none: replicas do not forward (a store writer could otherwise redirect traffic)",
    )
    allow: tuple[str, ...] = Field(
        default=PRIVATE,
        description="replica URLs forwarded to: ip/prefix networks (IP hosts, any port) or "
        "exact scheme://host:port origins; default: private and loopback IP addresses",
    )
    forward_window_seconds: float = Field(
        default=10.0,
        gt=0,
        description="a forwarding mark is believed this long after it was signed (clock "
        "difference between replicas included): how long a captured one replays",
    )

    @field_validator("allow", mode="before")
    @classmethod
    def _allow(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        for rule in value if isinstance(value, list | tuple) else ():
            if "://" in str(rule):
                if not str(rule).startswith(("http://", "https://")) or not _origin_host(rule):
                    raise ValueError(f"{rule}: not an http(s)://host:port origin")
            else:
                try:
                    ipaddress.ip_network(rule, strict=False)
                except ValueError:
                    raise ValueError(f"{rule}: not an ip/prefix network or URL") from None
        return value

    @field_validator("secret")
    @classmethod
    def _secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_SECRET:
            raise ValueError(f"at least {MIN_SECRET} characters (e.g. openssl rand -hex 32)")
        return value

    @property
    def key(self) -> bytes | None:
        """The secret as an HMAC key, or None."""
        return None if self.secret is None else self.secret.get_secret_value().encode()
