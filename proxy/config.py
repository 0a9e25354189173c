"""The one settings tree: typed, validated, immutable.

Settings come from three sources, merged in this order (later wins):

1. a YAML or TOML config file (``--config FILE`` or ``LLAMA_CACHE_PROXY_CONFIG``),
2. environment variables ``LLAMA_CACHE_PROXY_<FIELD>``; nested fields use ``__``
   (``LLAMA_CACHE_PROXY_QUEUE__MAX_WAITING=64``); ``BACKENDS`` is a comma-separated URL list,
3. command-line flags.

All three are validated by the same pydantic model, so a bad value fails the same way
wherever it came from: ``ConfigError`` carries one line naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
)

from proxy.config_sources import (
    ENV_PREFIX,
    ConfigError,
    deep_merge,
    env_overrides,
    read_config_file,
)
from proxy.core.disk_scope import parse_scope
from proxy.core.scoring import RoutingParams


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BackendSettings(_Frozen):
    """One llama-server instance."""

    url: AnyHttpUrl
    name: str | None = Field(
        default=None, description="label in metrics and logs; default host:port"
    )
    kv_reuse: Literal["prefix", "exact"] = Field(
        default="prefix",
        description="exact: hybrid/recurrent/SWA model, reuse only an exact extension of a slot",
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
        default=None, description="started with unified KV (-kvu); recorded with snapshots"
    )

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return f"{self.url.host}:{self.url.port}"

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")


class QueueSettings(_Frozen):
    """Requests wait here when every slot is busy."""

    max_waiting: int = Field(default=256, ge=0, description="queued requests before 503")
    max_wait_seconds: float = Field(default=30.0, gt=0, description="wait before 503")
    retry_after_seconds: int = Field(default=2, ge=1, description="Retry-After on a 503")


class TimeoutSettings(_Frozen):
    connect_seconds: float = Field(default=5.0, gt=0)
    read_seconds: float = Field(
        default=600.0, gt=0, description="max silence from a backend before 504 / stream error"
    )
    probe_seconds: float = Field(default=2.0, gt=0, description="timeout of one health probe")
    client_body_seconds: float = Field(
        default=30.0, gt=0, description="a client's upload must arrive within this (slow loris)"
    )


class HealthSettings(_Frozen):
    interval_seconds: float = Field(default=2.0, gt=0, description="backend probe period")
    drain_poll_seconds: float = Field(
        default=0.1, gt=0, description="poll period while an aborted slot finishes"
    )
    drain_max_seconds: float = Field(
        default=10.0, gt=0, description="give up waiting for an aborted slot after this"
    )


class RoutingSettings(_Frozen):
    """Prefix-aware routing (algorithm: proxy/core/routing.py)."""

    prefix_aware: bool = Field(default=True, description="false: least-busy backend, LRU slot")
    pin_slots: bool = Field(
        default=True,
        description="send id_slot; false: choose the backend, let llama-server choose the slot",
    )
    honor_client_id_slot: bool = Field(
        default=False, description="pin to the id_slot a client sends instead of choosing"
    )
    route_headers: bool = Field(
        default=True, description="add X-Cache-Route, -Predicted-Tokens, -Backend, -Slot, -Replica"
    )
    tokenizer: Literal["tiktoken", "backend"] = "tiktoken"
    block_tokens: int = Field(default=16, ge=4, description="raw-prompt fingerprint block size")
    min_prefix_tokens: int = Field(default=16, ge=0)
    wait_min_tokens: int = Field(default=1024, ge=0, description="saving worth waiting for")
    wait_min_fraction: float = Field(default=0.5, ge=0, le=1, description="...or this share")
    short_wait_tokens: int = Field(
        default=4, ge=0, description="a smaller saving worth a wait in a short queue; 0: off"
    )
    short_wait_depth: int = Field(
        default=4, ge=0, description="...while fewer requests than this wait for that slot"
    )
    max_slot_wait_seconds: float = Field(default=5.0, ge=0, description="wait for a busy slot")
    hold_max_seconds: float = Field(default=2.0, ge=0, description="slot held for a session")
    eviction_weight: float = Field(default=1.0, ge=0)
    value_half_life_seconds: float = Field(default=600.0, gt=0)
    balance_abs: int = Field(default=2, ge=0)
    balance_rel: float = Field(default=1.5, ge=1)
    cache_key_sources: tuple[str, ...] = Field(
        default=("prompt_cache_key", "header:x-session-id", "user"),
        description="where a session key comes from, first found wins",
    )
    slot_cache_key_similarity: float = Field(default=0.5, ge=0, le=1)
    slot_cache_key_min_prefix: int = Field(default=64, ge=0)
    affinity_ttl_seconds: float = Field(default=3600.0, gt=0)
    lease_ttl_seconds: float = Field(
        default=30.0, ge=1, description="a dead replica's slot leases expire after this"
    )

    def params(self) -> RoutingParams:
        """The pure policy's parameters (``core.scoring.RoutingParams``)."""
        return RoutingParams(
            min_prefix_tokens=self.min_prefix_tokens,
            wait_min_tokens=self.wait_min_tokens,
            wait_min_fraction=self.wait_min_fraction,
            short_wait_tokens=self.short_wait_tokens,
            short_wait_depth=self.short_wait_depth,
            eviction_weight=self.eviction_weight,
            value_half_life_s=self.value_half_life_seconds,
            balance_abs=self.balance_abs,
            balance_rel=self.balance_rel,
            key_similarity=self.slot_cache_key_similarity,
            key_min_prefix=self.slot_cache_key_min_prefix,
        )


class DiskSettings(_Frozen):
    """The disk tier of KV snapshots (algorithms: proxy/core/disk_scope.py, snapshots.py)."""

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
    park: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="save a warm session before evicting it; auto: on backends without "
        "llama-server's host-RAM prompt cache (there the server parks it in RAM itself)",
    )
    park_min_tokens: int = Field(default=1024, ge=1, description="smallest session parked")

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
    """Tenant cache isolation (algorithm: proxy/core/isolation.py)."""

    mode: Literal["off", "tenant"] = Field(
        default="off", description="tenant: never reuse another tenant's cached prefix"
    )
    tenant_header: str | None = Field(
        default=None, description="header naming the tenant; default: the bearer API key"
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare off as false


class Settings(_Frozen):
    """Root of the settings tree."""

    backends: tuple[BackendSettings, ...] = Field(min_length=1)
    listen: str = Field(default="127.0.0.1:8000", description="host:port to listen on")
    redis_url: str | None = Field(default=None, description="shared state; none = embedded")
    replica_url: str = Field(
        default="auto",
        description="this replica's URL as its peers reach it, to forward each request to the "
        "replica that routes its backend (with redis_url); auto: from listen; off: never",
    )
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    log_level: str = Field(default="INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$")
    admin_token: SecretStr | None = None
    queue: QueueSettings = QueueSettings()
    timeouts: TimeoutSettings = TimeoutSettings()
    health: HealthSettings = HealthSettings()
    routing: RoutingSettings = RoutingSettings()
    disk: DiskSettings = DiskSettings()
    isolation: IsolationSettings = IsolationSettings()

    @field_validator("backends", mode="before")
    @classmethod
    def _urls_to_backends(cls, value: Any) -> Any:
        """Comma-separated URLs, or (from the environment) a JSON list of backend objects."""
        if isinstance(value, str) and value.lstrip().startswith("["):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"backends: not a JSON list ({exc.msg})") from None
        if isinstance(value, str):
            value = [part for part in value.split(",") if part.strip()]
        if isinstance(value, list | tuple):
            return [{"url": item.strip()} if isinstance(item, str) else item for item in value]
        return value

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("must be host:port, e.g. 127.0.0.1:8000")
        return value

    @field_validator("replica_url")
    @classmethod
    def _replica_url(cls, value: str) -> str:
        if value not in ("auto", "off") and not value.startswith(("http://", "https://")):
            raise ValueError("must be auto, off or an http(s):// URL")
        return value.rstrip("/")

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value and not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return value or None

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "settings"
    return f"config: {field}: {first['msg']}"


def load_settings(
    *,
    cli: Mapping[str, Any],
    environ: Mapping[str, str],
    config_file: Path | None = None,
) -> Settings:
    """Merge file < env < cli and validate; raises ``ConfigError`` with one line."""
    path = config_file
    if path is None and environ.get(ENV_PREFIX + "CONFIG"):
        path = Path(environ[ENV_PREFIX + "CONFIG"])
    merged: dict[str, Any] = read_config_file(path) if path else {}
    merged = deep_merge(merged, env_overrides(environ))
    merged = deep_merge(merged, {k: v for k, v in cli.items() if v is not None})
    if "backends" not in merged:
        raise ConfigError("config: backends: at least one --backend URL is required")
    try:
        return Settings.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
