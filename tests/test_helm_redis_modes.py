"""The chart's Redis modes: standalone, sentinel and cluster render the settings and Secrets each needs.

Rendered with the pinned ``helm`` (``helm template``); the proxy's own ``load_config`` reads the
rendered config.yaml, so a rendering the proxy would refuse fails here.
"""

from __future__ import annotations

import pytest
import yaml

from proxy.config import load_config
from tests.support.helm import HelmError, containers, one, render

SENTINELS = ["redis-sentinel-0.data:26379", "redis-sentinel-1.data:26379", "redis-sentinel-2.data:26379"]
NODES = ["redis-cluster-0.data:6379", "redis-cluster-1.data:6379"]
MODES = {
    "standalone": {},
    "sentinel": {"proxy.redis.mode": "sentinel", "proxy.redis.sentinel.addresses": SENTINELS,
                 "proxy.redis.sentinel.serviceName": "toolproxy",
                 "proxy.redis.sentinel.passwordSecret": {"name": "sentinel-auth", "key": "pw"}},
    "cluster": {"proxy.redis.mode": "cluster", "proxy.redis.cluster.nodes": NODES},
}
SECRETS = {"proxy.redis.passwordSecret": {"name": "redis-auth", "key": "password"},
           "proxy.redis.tls.secretName": "redis-tls"}


def rendered(mode: str, **extra):
    values = {**MODES[mode], **SECRETS, **extra}
    if mode == "standalone":
        values["proxy.redis.url"] = "rediss://redis.data:6380/0"
    manifests = render(set_json=values)
    pod = one(manifests, "Deployment", "-agent")["spec"]["template"]["spec"]
    proxy = containers(pod)["toolproxy"]
    volume = next(v for v in pod["volumes"] if v["name"] == "toolproxy-config")
    data = one(manifests, "ConfigMap", volume["configMap"]["name"])["data"]["config.yaml"]
    env = {e["name"]: e for e in proxy["env"]}
    policy = one(manifests, "NetworkPolicy")
    return yaml.safe_load(data), env, policy


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_renders_its_settings_and_secrets_and_the_proxy_accepts_them(mode):
    config, env, policy = rendered(mode)
    redis = config["redis"]
    assert redis["mode"] == mode and redis["min_replica_acks"] == -1
    assert env["TOOLPROXY_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "redis-auth", "key": "password"}
    assert redis["tls_ca_file"].endswith("/ca.crt")
    if mode == "standalone":
        assert redis["url"] == "rediss://redis.data:6380/0" and "tls" not in redis
    else:
        assert "url" not in redis and redis["tls"] is True
    if mode == "sentinel":
        assert redis["sentinels"] == SENTINELS and redis["sentinel_service"] == "toolproxy"
        assert env["TOOLPROXY_REDIS_SENTINEL_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "sentinel-auth",
                                                                                          "key": "pw"}
    else:
        assert "TOOLPROXY_REDIS_SENTINEL_PASSWORD" not in env and "sentinels" not in redis
    assert ("cluster_nodes" in redis) == (mode == "cluster") and redis.get("cluster_nodes", NODES) == NODES
    redis_ports = {p["port"] for rule in policy["spec"]["egress"] for p in rule.get("ports", [])
                   if p["port"] in (6379, 26379)}
    assert redis_ports == ({6379, 26379} if mode == "sentinel" else {6379})
    # The proxy reads the rendered file as it would in the pod (password from the Secret's env).
    parsed = load_config(env={"TOOLPROXY_REDIS_PASSWORD": "pw"}, overrides={
        f"redis.{k}": v for k, v in redis.items()}).redis
    assert parsed.mode == mode and parsed.uses_tls and parsed.replica_acks == (0 if mode == "standalone" else 1)


@pytest.mark.parametrize("values,message", [
    ({"proxy.redis.mode": "sentinel"}, "needs proxy.redis.sentinel.addresses"),
    ({"proxy.redis.mode": "cluster"}, "needs proxy.redis.cluster.nodes"),
    ({"proxy.redis.mode": "cluster", "proxy.redis.cluster.nodes": NODES,
      "proxy.redis.urlSecret": {"name": "u", "key": "url"}}, "urlSecret is for mode=standalone"),
    ({"proxy.redis.mode": "replicated"}, "mode"),
    ({"proxy.redis.mode": "cluster", "proxy.redis.cluster.nodes": ["no-port"]}, "nodes"),
], ids=["sentinel-without-addresses", "cluster-without-nodes", "url-secret-in-cluster", "unknown-mode",
        "node-without-port"])
def test_incomplete_mode_settings_fail_the_render(values, message):
    with pytest.raises(HelmError, match=message):
        render(set_json=values)


def test_min_replica_acks_is_passed_through():
    config, _, _ = rendered("cluster", **{"proxy.redis.minReplicaAcks": 2})
    assert config["redis"]["min_replica_acks"] == 2


def test_eviction_is_refused_unless_the_values_accept_it():
    """proxy.redis.acceptEviction (default false) is redis.accept_eviction: the proxy refuses a Redis that may
    evict its records unless the chart's user says otherwise, by name."""
    config, _, _ = rendered("standalone")
    assert config["redis"]["accept_eviction"] is False
    config, _, _ = rendered("cluster", **{"proxy.redis.acceptEviction": True})
    assert config["redis"]["accept_eviction"] is True
    with pytest.raises(HelmError, match="acceptEviction"):
        render(set_json={"proxy.redis.acceptEviction": "yes"})
