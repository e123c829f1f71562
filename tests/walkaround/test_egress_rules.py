"""Walk-around: the egress guard in a real network namespace (issue 28, section 6).

The agent container shares the pod's network namespace with its guard. The
rules ``toolproxy egress-rules`` generates (the same command the chart's init
container runs) are applied inside a fresh namespace (``unshare --net``) with
three listeners standing in for a tool backend, Redis and OPA: a process
running as the proxy's UID connects to each; any other UID, root included, gets
a TCP reset; a port the proxy does not use stays open to everyone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.authoring.egress_rules import Destination, nft_script, peers, resolve
from proxy.config import ConfigError, load_config
from proxy.registry import load_registry
from tests.support.stack import DEMO_REGISTRY, REPO

HERE = Path(__file__).resolve().parent
PROXY_UID, AGENT_UID, OPA_UID = 10001, 10003, 10002  # the chart's runAsUser of each container


def netns_unavailable() -> str | None:
    """Why the namespace test cannot run here (None: it can). Only a machine without root, unshare or nft."""
    if os.geteuid() != 0:
        return "needs root to create a network namespace (unshare --net) and load nftables rules"
    for tool in ("unshare", "nft", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt-get install nftables util-linux iproute2)"
    probe = subprocess.run(["unshare", "--net", "nft", "list", "ruleset"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"unshare --net / nft are not permitted here: {probe.stderr.strip()[:200]}"
    return None


def test_only_the_proxy_uid_reaches_backend_redis_and_opa():
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    run = subprocess.run(["unshare", "--net", sys.executable, str(HERE / "egress_netns.py"), str(PROXY_UID),
                          str(AGENT_UID), str(OPA_UID), "0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    results = report["results"]
    guarded = ("backend", "redis", "opa")
    assert all(results[str(PROXY_UID)][peer] == "connected" for peer in guarded), results
    for uid in (AGENT_UID, OPA_UID, 0):
        assert all(results[str(uid)][peer] == "refused" for peer in guarded), (uid, results)
        assert results[str(uid)]["unguarded"] == "connected", (uid, results)  # only the proxy's peers are guarded
    assert f"meta skuid {PROXY_UID} accept" in report["rules"]
    for peer in guarded:
        assert f"tcp dport {report['ports'][peer]}" in report["rules"]


def test_the_rules_name_every_peer_of_the_config_and_registry(tmp_path):
    config = load_config(env={}, overrides={
        "backends.services": {"demo": "http://10.1.2.3:8080", "crm": "https://10.9.9.9"},
        "redis.mode": "sentinel", "redis.sentinels": ["10.0.0.7:26379", "10.0.0.8:26379"],
        "opa.url": "http://127.0.0.1:8181"})
    found = peers(config, load_registry([DEMO_REGISTRY]), ["192.168.0.0/16:6379"])
    script = nft_script(PROXY_UID, resolve(found))
    for line in ("ip daddr 10.1.2.3 tcp dport 8080", "ip daddr 10.9.9.9 tcp dport 443",
                 "ip daddr 10.0.0.7 tcp dport 26379", "ip daddr 10.0.0.8 tcp dport 26379",
                 "ip daddr 127.0.0.1 tcp dport 8181", "ip daddr 192.168.0.0/16 tcp dport 6379"):
        assert line in script, script
    assert script.index(f"meta skuid {PROXY_UID} accept") < script.index("reject")


def test_an_unresolvable_peer_stops_the_command_instead_of_leaving_it_open():
    config = load_config(env={}, overrides={"backends.services": {"gone": "http://no-such-host.invalid:8080"}})
    with pytest.raises(ConfigError, match="cannot resolve no-such-host.invalid"):
        resolve(peers(config, None))
    with pytest.raises(ConfigError, match="no peer"):
        nft_script(PROXY_UID, [])
    assert isinstance(resolve(peers(load_config(env={}), None))[0], Destination)


def test_the_command_refuses_root_and_prints_one_line_on_error():
    run = subprocess.run([sys.executable, "-m", "proxy.cli", "egress-rules", "--uid", "0", "--no-registry"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and "non-root" in run.stderr, run.stderr


def test_the_chart_installs_the_same_rules_before_any_other_container():
    from tests.support.helm import containers, one, render
    manifests = render(set_json={"egressGuard.extraDestinations": ["10.8.0.0/16:6379"]})
    pod = one(manifests, "Deployment", "-agent")["spec"]["template"]["spec"]
    first = pod["initContainers"][0]
    proxy = containers(pod)["toolproxy"]
    assert first["name"] == "toolproxy-egress-guard" and first["image"] == proxy["image"]
    uid = str(proxy["securityContext"]["runAsUser"])
    assert first["args"] == ["egress-rules", "--uid", uid, "--config", "/etc/toolproxy/config/config.yaml",
                             "--dest", "10.8.0.0/16:6379", "--apply"]
    assert first["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    assert containers(pod)["agent"]["securityContext"]["runAsUser"] != int(uid)
    off = one(render(set_values={"egressGuard.enabled": "false"}), "Deployment", "-agent")["spec"]["template"]["spec"]
    assert all(c["name"] != "toolproxy-egress-guard" for c in off.get("initContainers", []))
