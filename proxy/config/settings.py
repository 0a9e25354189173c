"""The one settings tree: typed, validated, immutable.

Settings come from three sources, merged in this order (later wins):

1. a YAML, TOML or JSON config file (``--config FILE`` or ``LLAMA_CACHE_PROXY_CONFIG``),
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
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator

from proxy.config.sections import (
    BackendSettings,
    DiskSettings,
    HealthSettings,
    IsolationSettings,
    QueueSettings,
    ReplicaSettings,
    RoutingSettings,
    TimeoutSettings,
    _Frozen,
    unset_if_empty,
)
from proxy.config.sources import (
    ENV_PREFIX,
    ConfigError,
    deep_merge,
    env_overrides,
    read_config_file,
)

__all__ = [
    "BackendSettings",
    "ConfigError",
    "DiskSettings",
    "HealthSettings",
    "IsolationSettings",
    "QueueSettings",
    "ReplicaSettings",
    "RoutingSettings",
    "Settings",
    "TimeoutSettings",
    "load_settings",
]


class Settings(_Frozen):
    """Root of the settings tree."""

    backends: tuple[BackendSettings, ...] = Field(min_length=1)
    listen: str = Field(
        default="127.0.0.1:8000",
        description="host:port to listen on; several hosts comma-separated, as llama-server's "
        "--host (127.0.0.1,::1:8000)",
    )
    redis_url: str | None = Field(default=None, description="shared state; none = embedded")
    replica_url: str = Field(
        default="auto",
        description="this replica's URL as its peers reach it, to forward each request to the "
        "replica that routes its backend (with redis_url); auto: from listen; off: never",
    )
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    log_level: str = Field(default="INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$")
    log_format: Literal["text", "json"] = Field(
        default="text", description="json: one JSON object per log line (log shippers)"
    )
    admin_token: SecretStr | None = None
    _admin_token = field_validator("admin_token", mode="before")(unset_if_empty)
    api_key: tuple[SecretStr, ...] = Field(
        default=(),
        description="keys clients must present, as llama-server's --api-key (comma-separated "
        "or a list): Authorization: Bearer KEY or X-Api-Key; none: the backends' api_keys, "
        "if any (else no key is checked)",
    )
    admin_churn_text: bool = Field(
        default=False,
        description="/admin/churn shows prompt excerpts and session keys; false: redacted "
        "(they are users' prompts and keys)",
    )
    queue: QueueSettings = QueueSettings()
    timeouts: TimeoutSettings = TimeoutSettings()
    health: HealthSettings = HealthSettings()
    routing: RoutingSettings = RoutingSettings()
    disk: DiskSettings = DiskSettings()
    isolation: IsolationSettings = IsolationSettings()
    replicas: ReplicaSettings = ReplicaSettings()

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

    @field_validator("api_key", mode="before")
    @classmethod
    def _keys(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",")]
        if isinstance(value, list | tuple) and any(
            isinstance(key, str) and not key.strip() for key in value
        ):  # (an unset shell variable, a stray comma: it would let any request in)
            raise ValueError("holds an empty key: omit api_key to check no key")
        return value

    @field_validator("backends")
    @classmethod
    def _distinct(cls, value: tuple[BackendSettings, ...]) -> tuple[BackendSettings, ...]:
        urls = [b.base_url for b in value]
        twice = next((url for url in urls if urls.count(url) > 1), None)
        if twice is not None:  # its slots would be modelled twice, and one pinned twice
            raise ValueError(f"{twice} is listed twice")
        labels = [b.label for b in value]
        if len(set(labels)) < len(labels):
            raise ValueError("two backends have one name (name:, or host:port)")
        return value

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        empty = not all(part.strip() for part in host.split(","))
        if "/" in value or not sep or empty or not port.isdigit():
            raise ValueError("must be host:port, e.g. 127.0.0.1:8000")
        if not 0 < int(port) < 65536:
            raise ValueError(f"port {port} is out of range (1 to 65535)")
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
        try:
            urlsplit(value or "").port  # noqa: B018 (a port out of range, or not a number)
        except ValueError as exc:
            raise ValueError(f"bad port: {exc}") from None
        return value or None

    @property
    def hosts(self) -> tuple[str, ...]:
        """The hosts to listen on (an IPv6 address may be written in brackets)."""
        parts = self.listen.rpartition(":")[0].split(",")
        return tuple(part.strip().removeprefix("[").removesuffix("]") for part in parts)

    @property
    def host(self) -> str:
        """The first of ``hosts`` (the one a replica advertises)."""
        return self.hosts[0]

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    def client_keys(self) -> tuple[str, ...]:
        """The keys clients must present: ``api_key``; without it, the keys of the backends
        started with ``--api-key`` (each forwarded request carries its backend's key in place
        of the client's, so a proxy checking none would let anyone use them: in front of such
        a server the proxy refuses what the server alone would refuse)."""
        if self.api_key:
            return tuple(key.get_secret_value() for key in self.api_key)
        return tuple(dict.fromkeys(b.key for b in self.backends if b.key is not None))


# settings that were removed, and what took their place: an old config names what to change
RETIRED = {
    "routing.hold_max_seconds": "holds are bounded by routing.max_slot_wait_seconds",
    "routing.short_wait_tokens": "short queues are gone; waits are weighed by the decision",
    "routing.short_wait_depth": "short queues are gone; waits are weighed by the decision",
    "routing.slot_cache_key_similarity": "a cache_key's slot wins ties; nothing to set",
    "routing.slot_cache_key_min_prefix": "a cache_key's slot must serve min_prefix_tokens",
}


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "settings"
    if first["type"] == "extra_forbidden" and field in RETIRED:
        return f"config: {field}: removed ({RETIRED[field]})"
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
