"""The deployment files are valid, and every metric the dashboard and alerts use exists.

No Docker engine or Kubernetes cluster runs here: the compose file is checked with Debian's
``docker-compose config``, the Prometheus config and rules with ``promtool``, the Kubernetes
manifests structurally, and the dashboard's and alert rules' metric names against the
``/metrics`` of a live proxy that served traffic (every metric family is listed there).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import chat

ROOT = Path(__file__).parents[1]
DEPLOY = ROOT / "deploy"
PROFILES = [["cpu", "redis", "monitoring"], ["cuda", "redis", "monitoring"], ["metal"]]
METRIC = re.compile(r"\bllama_cache_proxy_[a-z_]+")


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is missing: ./scripts/test installs it (Debian package)")
    return found


SECRETS = {"REDIS_PASSWORD": "redis-password-hex", "REPLICA_SECRET": "replica-secret-hex"}


def _compose_config(profiles: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    args = [_tool("docker-compose"), "-f", str(ROOT / "docker-compose.yml")]
    for profile in profiles:
        args += ["--profile", profile]
    environ = {k: v for k, v in os.environ.items() if k not in SECRETS} | env
    return subprocess.run([*args, "config"], capture_output=True, text=True, cwd=ROOT, env=environ)


@pytest.mark.parametrize("profiles", PROFILES, ids=["+".join(p) for p in PROFILES])
def test_compose_file_validates(profiles: list[str]) -> None:
    done = _compose_config(profiles, SECRETS)
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]  # compose 1.29 lists every profile
    assert {"lb", "proxy", "proxy-metal", "redis", "prometheus", "grafana"} <= set(services)
    assert services["proxy"]["environment"]["LLAMA_CACHE_PROXY_DISK__SLOT_SAVE_DIR"] == "/slots"
    backends = [s for name, s in services.items() if name.startswith("llama")]
    assert len(backends) == 4  # two CPU, two CUDA
    for backend in backends:
        command = backend["command"]
        command = command if isinstance(command, str) else " ".join(command)
        assert "--slot-save-path /slots" in command
        assert "-np 4" in command  # explicit slots: non-unified KV, as pinning needs
        assert "--no-cache-idle-slots" in command  # and the proxy is told so:
    from proxy.config.settings import Settings

    raw = services["proxy"]["environment"]["LLAMA_CACHE_PROXY_BACKENDS"]
    proxied = Settings.model_validate({"backends": raw}).backends
    assert [(b.base_url, b.cache_idle_slots) for b in proxied] == [
        ("http://llama-0:8080", False),
        ("http://llama-1:8080", False),
    ]


def test_compose_redis_needs_a_password_and_only_the_proxies_reach_it() -> None:
    """Redis requires AUTH and TLS, publishes no port and sits on an internal network only
    the proxies join; the proxies get its password and the replicas' secret. Neither may be
    left unset: compose refuses the file."""
    for missing in SECRETS:
        done = _compose_config(["cpu", "redis"], {k: v for k, v in SECRETS.items() if k != missing})
        assert done.returncode != 0
        assert f"set {missing}" in done.stderr
    config = yaml.safe_load(_compose_config(["cpu", "redis"], SECRETS).stdout)
    services = config["services"]
    redis = services["redis"]
    command = " ".join(redis["command"])
    assert "--requirepass" in command
    assert "--port 0 --tls-port 6379" in command  # TLS only
    assert services["redis-tls"]["network_mode"] == "none"
    assert redis["environment"]["REDIS_PASSWORD"] == SECRETS["REDIS_PASSWORD"]
    assert "ports" not in redis
    assert set(redis["networks"]) == {"state"}
    assert config["networks"]["state"]["internal"] is True
    on_state = {name for name, s in services.items() if "state" in (s.get("networks") or {})}
    assert on_state == {"redis", "proxy"}
    env = services["proxy"]["environment"]
    url = "rediss://:redis-password-hex@redis:6379/0?ssl_ca_certs=/tls/ca.crt"
    assert env["LLAMA_CACHE_PROXY_REDIS_URL"] == url
    assert env["LLAMA_CACHE_PROXY_REPLICAS__SECRET"] == SECRETS["REPLICA_SECRET"]


def test_prometheus_config_and_alert_rules_check() -> None:
    promtool = _tool("promtool")
    config = DEPLOY / "prometheus" / "prometheus.yml"
    done = subprocess.run(
        [promtool, "check", "config", str(config)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 rules found" in done.stdout


def _manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _uid() -> str:
    """The proxy image's user id (deploy/Dockerfile)."""
    found = re.search(r"--uid (\d+)", (DEPLOY / "Dockerfile").read_text())
    assert found is not None
    return found.group(1)


def test_the_proxies_own_the_snapshot_directory() -> None:
    """llama-server (root in its image) saves snapshots into the shared directory; the
    proxies, which run as the image's user, delete evicted ones, which needs write permission
    on the directory: a one-shot step gives it to that user before a proxy starts."""
    uid = _uid()
    services = yaml.safe_load(_compose_config(PROFILES[0], SECRETS).stdout)["services"]
    init = services["slots-init"]
    assert init["command"] == ["chown", f"{uid}:{uid}", "/slots"]
    assert init["volumes"] == ["slots:/slots:rw"]
    assert services["proxy"]["depends_on"]["slots-init"] == {
        "condition": "service_completed_successfully"
    }
    llama = next(d for d in _manifests() if d.get("metadata", {}).get("name") == "llama"
                 and d["kind"] == "StatefulSet")  # fmt: skip
    (owner,) = llama["spec"]["template"]["spec"]["initContainers"]
    assert owner["command"] == ["chown", f"{uid}:{uid}", "/slots"]
    assert {m["mountPath"] for m in owner["volumeMounts"]} == {"/slots"}
    proxy = next(d for d in _manifests() if d["kind"] == "Deployment")
    assert str(proxy["spec"]["template"]["spec"]["securityContext"]["runAsUser"]) == uid


def test_kubernetes_manifests_are_well_formed() -> None:
    docs = _manifests()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Deployment", "llama-cache-proxy") in kinds
    assert ("StatefulSet", "llama") in kinds
    assert ("ServiceMonitor", "llama-cache-proxy") in kinds
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for doc in docs:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys()
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = doc["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        mounts = set()
        for container in spec["template"]["spec"]["containers"]:
            assert container["name"]
            assert container["image"]
            mounts |= {m["name"] for m in container.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in spec["template"]["spec"].get("volumes", [])}
        templates = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
        assert mounts <= set(volumes) | templates, doc["metadata"]["name"]
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["config.yaml"]
    from proxy.config.settings import Settings

    settings = Settings.model_validate(yaml.safe_load(config))  # the proxy accepts it
    assert [(b.base_url, b.cache_idle_slots) for b in settings.backends] == [
        ("http://llama-0.llama:8080", False),
        ("http://llama-1.llama:8080", False),
    ]
    llama = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "llama")
    assert "--no-cache-idle-slots" in llama["spec"]["template"]["spec"]["containers"][0]["args"]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_kubernetes_redis_takes_tls_and_a_password_and_only_proxies_reach_it() -> None:
    """Redis listens on TLS only, with a password from a Secret; the proxy connects with
    rediss:// and that password, and signs with the replicas' secret from the same Secret;
    NetworkPolicies let only the proxy's pods reach Redis and llama-server."""
    docs = _manifests()
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    redis = pods["redis"]["containers"][0]
    args = redis["args"]
    assert args[args.index("--port") + 1] == "0"  # no plain-text port
    assert args[args.index("--tls-port") + 1] == "6380"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    ref = {"secretKeyRef": {"name": "llama-cache-proxy", "key": "redis-password"}}
    assert _env(redis)["REDIS_PASSWORD"] == ref
    proxy = _env(pods["llama-cache-proxy"]["containers"][0])
    assert proxy["REDIS_PASSWORD"] == ref
    assert proxy["LLAMA_CACHE_PROXY_REDIS_URL"].startswith(
        "rediss://:$(REDIS_PASSWORD)@redis:6380/"
    )
    secret = {"secretKeyRef": {"name": "llama-cache-proxy", "key": "replica-secret"}}
    assert proxy["LLAMA_CACHE_PROXY_REPLICAS__SECRET"] == secret
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    only_proxies = [{"podSelector": {"matchLabels": {"app": "llama-cache-proxy"}}}]
    for name, port in (("redis", 6380), ("llama", 8080)):
        spec = policies[name]
        assert spec["podSelector"] == {"matchLabels": {"app": name}}
        assert spec["policyTypes"] == ["Ingress"]
        assert [rule["from"] for rule in spec["ingress"]] == [only_proxies]
        assert [rule["ports"] for rule in spec["ingress"]] == [[{"port": port}]]


def test_grafana_provisioning_parses() -> None:
    source = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert source["datasources"][0]["uid"] == "prometheus"
    board = json.loads((DEPLOY / "grafana/dashboards/llama-cache-proxy.json").read_text())
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert {p["datasource"]["uid"] for p in panels} == {"prometheus"}
    assert all(p["targets"] for p in panels)


def _used_metric_names() -> set[str]:
    board = (DEPLOY / "grafana/dashboards/llama-cache-proxy.json").read_text()
    rules = (DEPLOY / "prometheus/alerts.yml").read_text()
    return set(METRIC.findall(board)) | set(METRIC.findall(rules))


async def test_dashboard_and_alert_metrics_exist_on_a_live_proxy(
    fakes: Any, proxy: Any, tmp_path: Path
) -> None:
    fake = await fakes(n_slots=2, save_dir=tmp_path)
    client = await proxy([fake], disk={"slot_save_dir": str(tmp_path), "min_tokens": 8})
    for i in range(3):
        body = chat(f"dashboard traffic {i}", max_tokens=4, stream=i % 2 == 0)
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
    page = await (await client.get("/metrics")).text()
    exposed = set()
    for line in page.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            exposed.add(name)
            if kind == "counter":
                exposed.add(name + "_total")
            if kind == "histogram":
                exposed |= {name + "_bucket", name + "_sum", name + "_count"}
    used = _used_metric_names()
    assert len(used) >= 15
    assert used <= exposed, sorted(used - exposed)
