from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from proxy.cli import main
from proxy.config.settings import Settings, load_settings
from proxy.config.sources import ConfigError, read_config_file

EXAMPLE = Path(__file__).parents[2] / "deploy" / "config.example.yaml"


def _fields(model: type[Settings] | object, prefix: str = "") -> set[str]:
    out = set()
    for name, info in model.model_fields.items():  # type: ignore[union-attr]
        annotation = info.annotation
        if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
            out |= _fields(annotation, f"{prefix}{name}.")
        else:
            out.add(prefix + name)
    return out


def _keys(data: dict[str, object], prefix: str = "") -> set[str]:
    out = set()
    for key, value in data.items():
        if isinstance(value, dict) and key != "backends":
            out |= _keys(value, f"{prefix}{key}.")
        else:
            out.add(prefix + key)
    return out


def test_example_config_is_valid_and_lists_every_field() -> None:
    settings = load_settings(cli={}, environ={}, config_file=EXAMPLE)
    assert [b.label for b in settings.backends] == ["gpu0", "gpu1"]
    assert _keys(yaml.safe_load(EXAMPLE.read_text())) == _fields(Settings)


def test_precedence_file_then_env_then_cli(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('backends = ["http://a:1"]\nlisten = "0.0.0.0:1"\n[queue]\nmax_waiting = 5\n')
    env = {"LLAMA_CACHE_PROXY_LISTEN": "0.0.0.0:2", "LLAMA_CACHE_PROXY_QUEUE__MAX_WAITING": "7"}
    settings = load_settings(cli={"listen": "0.0.0.0:3"}, environ=env, config_file=path)
    assert settings.listen == "0.0.0.0:3"
    assert settings.queue.max_waiting == 7
    assert settings.backends[0].base_url == "http://a:1"


def test_env_backends_comma_separated_and_config_path_from_env(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("log_level: DEBUG\n")
    env = {"LLAMA_CACHE_PROXY_BACKENDS": "http://a:1,http://b:2",
           "LLAMA_CACHE_PROXY_CONFIG": str(path)}  # fmt: skip
    settings = load_settings(cli={}, environ=env)
    assert [b.label for b in settings.backends] == ["a:1", "b:2"]
    assert settings.log_level == "DEBUG"


def test_env_backends_as_a_json_list_carry_per_backend_fields() -> None:
    """How a compose file or a container sets per-backend fields without a config file."""
    raw = '[{"url": "http://a:1", "cache_idle_slots": false}, {"url": "http://b:2"}]'
    settings = load_settings(cli={}, environ={"LLAMA_CACHE_PROXY_BACKENDS": raw})
    assert [(b.label, b.cache_idle_slots) for b in settings.backends] == [
        ("a:1", False),
        ("b:2", True),
    ]
    with pytest.raises(ConfigError, match="not a JSON list"):
        load_settings(cli={}, environ={"LLAMA_CACHE_PROXY_BACKENDS": '[{"url": '})


def test_settings_are_immutable() -> None:
    settings = load_settings(cli={"backends": ["http://a:1"]}, environ={})
    with pytest.raises(ValueError, match="frozen"):
        settings.listen = "x:1"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("cli", "env", "field"),
    [
        ({}, {}, "backends"),
        ({"backends": ["not a url"]}, {}, "backends.0.url"),
        ({"backends": ["http://a:1"], "listen": "nope"}, {}, "listen"),
        ({"backends": ["http://a:1"]}, {"LLAMA_CACHE_PROXY_QUEUE__MAX_WAITING": "-1"},
         "queue.max_waiting"),
        ({"backends": ["http://a:1"], "redis_url": "http://x"}, {}, "redis_url"),
        ({"backends": ["http://a:1"], "replica_url": "a:1"}, {}, "replica_url"),
        ({"backends": ["http://a:1"]}, {"LLAMA_CACHE_PROXY_NOPE": "1"}, "nope"),
        ({"backends": ["http://a:1"], "disk": {"prefix_cache": "auto:0"}}, {},
         "disk.prefix_cache"),
        # an empty key would let any request in (an unset shell variable, a stray comma)
        ({"backends": ["http://a:1"], "api_key": ""}, {}, "api_key"),
        ({"backends": ["http://a:1"], "api_key": ["k", ""]}, {}, "api_key"),
        # one backend twice: its slots modelled twice, and one pinned twice
        ({"backends": ["http://a:1", "http://a:1/"]}, {}, "backends"),
        ({"backends": ["http://user:pass@a:1"]}, {}, "backends.0.url"),  # (logged, never sent)
        ({"backends": ["http://a:1?x=1"]}, {}, "backends.0.url"),
        # an OpenAI base URL: every forwarded /v1/... would go to /v1/v1/...
        ({"backends": ["http://a:1/v1"]}, {}, "backends.0.url"),
        ({"backends": ["http://a:1/gw/v1/"]}, {}, "backends.0.url"),
        ({"backends": ["http://a:1"], "redis_url": "redis://localhost:99999"}, {}, "redis_url"),
        ({"backends": ["http://a:1"], "listen": "127.0.0.1:99999"}, {}, "listen"),
        ({"backends": ["http://a:1"], "listen": "http://127.0.0.1:8000"}, {}, "listen"),
        ({"backends": ["http://a:1"], "timeouts": {"connect_seconds": float("inf")}}, {},
         "timeouts.connect_seconds"),
    ],
)  # fmt: skip
def test_bad_config_is_one_line_naming_the_field(
    cli: dict[str, object], env: dict[str, str], field: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(cli=cli, environ=env)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"config: {field}:")


def test_a_backend_behind_a_path_prefix_keeps_it() -> None:
    settings = load_settings(cli={"backends": ["http://a:1/gw/llama-0/"]}, environ={})
    assert settings.backends[0].base_url == "http://a:1/gw/llama-0"


def test_a_removed_setting_names_what_took_its_place() -> None:
    env = {"LLAMA_CACHE_PROXY_ROUTING__HOLD_MAX_SECONDS": "2"}
    with pytest.raises(ConfigError) as info:
        load_settings(cli={"backends": ["http://a:1"]}, environ=env)
    assert str(info.value) == (
        "config: routing.hold_max_seconds: removed "
        "(holds are bounded by routing.max_slot_wait_seconds)"
    )


def test_cli_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--backend", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "backends.0.url" in err


def test_unreadable_or_invalid_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(cli={}, environ={}, config_file=tmp_path / "missing.yaml")
    bad = tmp_path / "bad.toml"
    bad.write_text("= nope")
    with pytest.raises(ConfigError, match="not valid"):
        load_settings(cli={}, environ={}, config_file=bad)


def test_disk_flags_reach_the_settings(tmp_path: Path) -> None:
    from proxy.cli import _parser, settings_from_args

    args = _parser().parse_args(
        [
            "serve",
            "--backend",
            "http://a:1",
            "--disk-prefix-cache",
            "auto:8",
            "--kv-cache-min-tokens",
            "512",
            "--disk-cache-max-bytes",
            "1000000",
            "--slot-save-dir",
            str(tmp_path),
        ]
    )
    disk = settings_from_args(args, {}).disk
    assert (disk.prefix_cache, disk.min_tokens, disk.max_bytes) == ("auto:8", 512, 1000000)
    assert disk.slot_save_dir == str(tmp_path)
    assert load_settings(cli={"backends": ["http://a:1"]}, environ={}).disk.prefix_cache == (
        "auto:30"
    )


def test_yaml_bare_off_means_off(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("backends: [http://a:1]\ndisk: {prefix_cache: off}\nisolation: {mode: off}\n")
    settings = load_settings(cli={}, environ={}, config_file=path)
    assert settings.disk.prefix_cache == "off"
    assert settings.isolation.mode == "off"


def test_log_format_json_makes_every_log_line_one_json_object() -> None:
    import io
    import json
    import logging

    from proxy.cli import _configure_logging, _parser, settings_from_args

    args = _parser().parse_args(["serve", "--backend", "http://a:1", "--log-format", "json"])
    settings = settings_from_args(args, {})
    assert settings.log_format == "json"
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        _configure_logging("INFO", settings.log_format)
        out = io.StringIO()
        root.handlers[0].setStream(out)  # type: ignore[attr-defined]
        logging.getLogger("proxy.test").info("a\nb")
    finally:
        root.handlers[:] = saved
    (line,) = out.getvalue().splitlines()
    assert json.loads(line)["message"] == "a\nb"


def test_api_keys_from_the_environment_and_per_backend() -> None:
    backends = '[{"url": "http://a:1", "api_key": "s3cret-b"}]'
    env = {"LLAMA_CACHE_PROXY_BACKENDS": backends, "LLAMA_CACHE_PROXY_API_KEY": "k1, k2"}
    settings = load_settings(cli={}, environ=env)
    assert [k.get_secret_value() for k in settings.api_key] == ["k1", "k2"]
    assert settings.backends[0].key == "s3cret-b"
    assert "s3cret-b" not in repr(settings)


@pytest.mark.parametrize("secret", ["", "fifteen chars!!"])
def test_a_replica_secret_anyone_could_guess_is_refused(secret: str) -> None:
    """An empty ``replicas.secret`` was accepted: every replica signed with the key b""."""
    env = {"LLAMA_CACHE_PROXY_BACKENDS": "http://a:1", "LLAMA_CACHE_PROXY_REPLICAS__SECRET": secret}
    with pytest.raises(ConfigError, match=r"^config: replicas\.secret: .*at least 16") as info:
        load_settings(cli={}, environ=env)
    assert "chars!!" not in str(info.value)  # (the secret is not echoed)
    env["LLAMA_CACHE_PROXY_REPLICAS__SECRET"] = "sixteen chars!!!"
    assert load_settings(cli={}, environ=env).replicas.key == b"sixteen chars!!!"


@pytest.mark.parametrize("rule", ["http://peer:99999", "http://peer:x", "http://peer:0"])
def test_an_allowed_origin_with_a_port_that_is_not_one_is_refused(rule: str) -> None:
    """It passed, and checking a replica URL against it raised ValueError."""
    with pytest.raises(ConfigError, match=r"^config: replicas\.allow: "):
        load_settings(cli={"backends": ["http://a:1"], "replicas": {"allow": [rule]}}, environ={})


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    utf16 = tmp_path / "proxy.yaml"
    utf16.write_text("listen: 127.0.0.1:8000\n", encoding="utf-16")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_settings(cli={}, environ={}, config_file=utf16)


def test_environment_variables_that_set_a_value_and_a_part_of_it_conflict() -> None:
    env = {
        "LLAMA_CACHE_PROXY_DISK": "x",
        "LLAMA_CACHE_PROXY_DISK__PARK": "on",
    }
    with pytest.raises(ConfigError, match="conflict"):
        load_settings(cli={"backends": ["http://a:1"]}, environ=env)


def test_an_ipv6_host_may_be_written_in_brackets() -> None:
    settings = load_settings(cli={"backends": ["http://a:1"], "listen": "[::1]:8000"}, environ={})
    assert (settings.hosts, settings.port) == (("::1",), 8000)


def test_a_port_in_use_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", "--backend", "http://127.0.0.1:1", "--listen", f"127.0.0.1:{port}"]
        assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot listen on" in err
    assert err.count("\n") == 0


def test_a_yaml_error_names_its_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "proxy.yaml"
    bad.write_text("listen: 127.0.0.1:8000\nbackends: [http://a:1\n")
    with pytest.raises(ConfigError, match=r"line \d+, column \d+"):
        load_settings(cli={}, environ={}, config_file=bad)


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        (
            "proxy.yaml",
            "routing:\n  min_prefix_tokens: 8\nrouting:\n  wait_min_tokens: 9\n",
            "line 3",
        ),
        ("proxy.yaml", "routing:\n  min_prefix_tokens: 8\n  min_prefix_tokens: 64\n", "line 3"),
        ("proxy.json", '{"routing": {"min_prefix_tokens": 8, "min_prefix_tokens": 64}}', ""),
    ],
)
def test_a_key_given_twice_is_an_error_not_the_last_one_kept(
    tmp_path: Path, name: str, text: str, where: str
) -> None:
    """Either value would silently be lost: the file is refused, naming the key."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"{where}.*given twice") as raised:
        load_settings(cli={}, environ={}, config_file=path)
    assert "'routing'" in str(raised.value) or "'min_prefix_tokens'" in str(raised.value)


def test_yaml_merge_keys_may_give_a_key_again(tmp_path: Path) -> None:
    """``<<: *base`` then the same key overrides the base's: YAML's own rule, not a repeat."""
    path = tmp_path / "proxy.yaml"
    path.write_text(
        "base: &base {min_prefix_tokens: 8, wait_min_tokens: 9}\n"
        "routing:\n  <<: *base\n  min_prefix_tokens: 32\n"
    )
    assert read_config_file(path)["routing"] == {"min_prefix_tokens": 32, "wait_min_tokens": 9}


def test_without_client_keys_the_proxy_checks_its_backends_keys() -> None:
    """A backend's api_key is sent on every request it serves: with no api_key of the proxy's
    own, clients must present a backend's key, as the backend alone would require."""
    keyed = {"backends": [{"url": "http://a:8080", "api_key": "k"}, "http://b:8080"]}
    assert Settings(**keyed).client_keys() == ("k",)
    assert Settings(**keyed, api_key="client").client_keys() == ("client",)
    assert Settings(backends=["http://b:8080"]).client_keys() == ()
    hosts = [("a", "k"), ("b", "k"), ("c", "j")]
    three = {"backends": [{"url": f"http://{h}:8080", "api_key": k} for h, k in hosts]}
    assert Settings(**three).client_keys() == ("k", "j")


def test_an_empty_string_leaves_an_optional_setting_unset() -> None:
    """``LLAMA_CACHE_PROXY_ADMIN_TOKEN: ${ADMIN_TOKEN:-}`` (the compose file) with no token:
    admin stays off, as with no variable at all, instead of on with a token none can give."""
    env = {
        "LLAMA_CACHE_PROXY_ADMIN_TOKEN": "",
        "LLAMA_CACHE_PROXY_DISK__SLOT_SAVE_DIR": "",
        "LLAMA_CACHE_PROXY_ISOLATION__TENANT_HEADER": "",
    }
    settings = load_settings(cli={"backends": ["http://b:8080"]}, environ=env)
    assert settings.admin_token is None
    assert settings.disk.slot_save_dir is None
    assert settings.isolation.tenant_header is None


@pytest.mark.parametrize(
    "value",
    ["prompt_cache_key, header:x-session-id", '["prompt_cache_key", "header:x-session-id"]'],
)
def test_cache_key_sources_from_the_environment(value: str) -> None:
    env = {"LLAMA_CACHE_PROXY_ROUTING__CACHE_KEY_SOURCES": value}
    settings = load_settings(cli={"backends": ["http://b:8080"]}, environ=env)
    assert settings.routing.cache_key_sources == ("prompt_cache_key", "header:x-session-id")


def test_a_request_waits_for_a_slot_as_long_as_a_backend_may_stay_silent() -> None:
    """llama-server queues without a bound: a client's wait ends no sooner through the proxy
    than the read timeout would end it directly."""
    settings = Settings(backends=["http://b:8080"])
    assert settings.queue.max_wait_seconds == settings.timeouts.read_seconds
