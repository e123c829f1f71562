"""Walk-around: the egress guard in a real network namespace.

The agent container shares the pod's network namespace with its guard. The rules ``toolproxy egress-rules``
generates (the same command the chart's init container runs) are applied inside a fresh namespace
(``unshare --net``): default-deny for every UID but the proxy's. A peer of the proxy that answers on three
addresses (a Service's ClusterIP and its pods' IPs stand for them) is refused on every one of them to the
agent's UID, OPA's and root, and reached on each by the proxy's UID; the other UIDs still reach the proxy's
agent port on loopback, DNS and the allow-listed model API, and nothing else (the proxy's admin port).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.guard.egress_rules import Allowed, nft_script
from proxy.config import ConfigError
from tests.support.stack import REPO

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


def test_a_peer_is_refused_to_every_other_uid_at_each_of_its_addresses_and_reached_by_the_proxy():
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    run = subprocess.run(["unshare", "--net", sys.executable, str(HERE / "egress_netns.py"), str(PROXY_UID),
                          str(AGENT_UID), str(OPA_UID), "0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    results = report["results"]
    addresses = ("peer", "peer_second_address", "peer_third_address")
    assert set(results[str(PROXY_UID)].values()) == {"connected"}, results
    for uid in (AGENT_UID, OPA_UID, 0):
        assert all(results[str(uid)][target] == "refused" for target in (*addresses, "admin")), (uid, results)
        assert all(results[str(uid)][target] == "connected" for target in ("agent_port", "dns", "model")), \
            (uid, results)
    assert f"meta skuid {PROXY_UID} accept" in report["rules"]
    assert "reject with tcp reset" in report["rules"]


def test_the_rules_allow_only_the_agent_port_dns_and_the_allow_list_and_resolve_nothing():
    script = nft_script([PROXY_UID, OPA_UID], 8787, [Allowed.parse("203.0.113.0/24:443"),
                                                     Allowed.parse("[2001:db8::7]:443")], dns=["10.96.0.10"])
    for line in (f"meta skuid {PROXY_UID} accept", f"meta skuid {OPA_UID} accept",
                 'oifname "lo" tcp dport 8787 accept', "ip daddr 10.96.0.10 udp dport 53 accept",
                 "ip daddr 10.96.0.10 tcp dport 53 accept", "ip daddr 203.0.113.0/24 tcp dport 443 accept",
                 "ip6 daddr 2001:db8::7 tcp dport 443 accept"):
        assert line in script, script
    assert script.index(f"meta skuid {PROXY_UID} accept") < script.index("reject")
    assert script.rstrip().splitlines()[-3:] == ["    counter reject", "  }", "}"]  # default deny, last
    with pytest.raises(ConfigError, match="not a name"):
        Allowed.parse("api.example.com:443")  # a name is never resolved: its addresses change
    with pytest.raises(ConfigError, match="ADDRESS:PORT"):
        Allowed.parse("203.0.113.0/24")
    with pytest.raises(ConfigError, match="non-root"):
        nft_script([0], 8787)


def test_the_command_refuses_root_and_prints_one_line_on_error():
    for args in (["--uid", "0"], ["--uid", "10001", "--allow", "api.example.com:443"]):
        run = subprocess.run([sys.executable, "-m", "proxy.cli", "egress-rules", *args],
                             cwd=REPO, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
        assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert "non-root" in subprocess.run([sys.executable, "-m", "proxy.cli", "egress-rules", "--uid", "0"], cwd=REPO,
                                        capture_output=True, text=True, timeout=60).stderr


def test_the_chart_installs_the_same_rules_before_any_other_container():
    from tests.support.helm import CHART, containers, one, render
    manifests = render([CHART / "ci" / "egress-guard-values.yaml"])  # opt-in: it needs a privileged namespace
    pod = one(manifests, "Deployment", "-agent")["spec"]["template"]["spec"]
    first = pod["initContainers"][0]
    proxy = containers(pod)["toolproxy"]
    assert first["name"] == "toolproxy-egress-guard" and first["image"] == proxy["image"]
    uid = str(proxy["securityContext"]["runAsUser"])
    assert first["args"][:3] == ["egress-rules", "--uid", uid] and first["args"][-1] == "--apply"
    # The command takes what the chart renders (printing instead of applying, with the config's port given).
    args = [a for a in first["args"][:-1]]
    if "--config" in args:
        del args[args.index("--config"):args.index("--config") + 2]
    printed = subprocess.run([sys.executable, "-m", "proxy.cli", *args, "--agent-port", "8787"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0 and f"meta skuid {uid} accept" in printed.stdout, printed.stderr
    assert first["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN"]}
    assert containers(pod)["agent"]["securityContext"]["runAsUser"] != int(uid)
    off = one(render(), "Deployment", "-agent")["spec"]["template"]["spec"]  # the default, restricted
    assert all(c["name"] != "toolproxy-egress-guard" for c in off.get("initContainers", []))
