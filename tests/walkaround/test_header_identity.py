"""Walk-around: header identity without a proof of the hop (issue 28, section 5).

The agent container shares the proxy's network namespace, so in headers mode
"whoever connects" is the agent. It must not be able to name a subject and a
tenant by setting ``X-Auth-*`` itself: only a request with the mesh's secret,
or with Envoy's XFCC from a configured trusted proxy, is believed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.mesh import HOP_HEADER, HOP_SECRET, mesh_headers, mesh_settings
from tests.support.stack import DEMO_REGISTRY, REPO, running_stack

FORGED = {"X-Auth-Subject": "gina", "X-Auth-Tenant": "globex", "X-Auth-Roles": "agent admin",
          "X-Auth-Scopes": "tools:read tools:write"}
PROXY_ID = "spiffe://cluster.local/ns/shop/sa/ingress-gateway"
CLIENT = 'Hash=9ba61d6425303443c0748a02dd8de688468ed33be74eee6556d90c0149c1309e;URI="spiffe://cluster.local/ns/shop/sa/agent"'


def run_headers_mode(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", "run"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "TOOLPROXY_REGISTRY_PATHS": str(DEMO_REGISTRY),
                                           "TOOLPROXY_IDENTITY_MODE": "headers",
                                           "TOOLPROXY_IDENTITY_AGENT_ID": "agent-under-test", **env})


def test_headers_mode_without_a_hop_proof_does_not_start():
    result = run_headers_mode({})
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "proof of the trusted hop" in result.stderr and "Traceback" not in result.stderr
    assert "identity.headers.proof_secret_file" in result.stderr


def test_a_short_or_unreadable_hop_secret_does_not_start(tmp_path):
    short = tmp_path / "short"
    short.write_text("123")
    for path, words in ((short, "at least 16 bytes"), (tmp_path / "missing", "cannot read")):
        result = run_headers_mode({"TOOLPROXY_IDENTITY_HEADERS_PROOF_SECRET_FILE": str(path)})
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
        assert words in result.stderr and "Traceback" not in result.stderr


async def test_forged_identity_headers_without_the_mesh_secret_are_refused(proxy_deps, tmp_path):
    async with running_stack({**proxy_deps, **mesh_settings(tmp_path)}) as stack:
        for headers in (FORGED, {**FORGED, HOP_HEADER: ""}, {**FORGED, HOP_HEADER: HOP_SECRET[:-1]},
                        {**FORGED, HOP_HEADER: HOP_SECRET + "x"}, {**FORGED, HOP_HEADER.lower(): "mesh-guess"}):
            status, env = await stack.call("get_order", {"order_id": "ord_2001"}, headers=headers)
            assert status == 401 and env["error"]["code"] == "unauthorized", (headers, env)
        assert not stack.backend.requests  # nothing reached a backend
        # The mesh's own request, with the secret, is believed.
        status, env = await stack.call("get_order", {"order_id": "ord_2001"}, headers=mesh_headers("gina", "globex"))
        assert status == 200 and env["data"]["tenant"] == "globex", env
        assert stack.backend.requests[-1]["headers"]["X-Toolproxy-Subject"] == "gina"
        assert HOP_HEADER not in stack.backend.requests[-1]["headers"]  # the secret never travels on


TRUSTED = "203.0.113.0/24"  # TEST-NET-3 (documentation addresses: not this machine's)
INSIDE, OUTSIDE = "203.0.113.10", "198.51.100.1"
GOOD = {**FORGED, "X-Forwarded-Client-Cert": f"By={PROXY_ID};{CLIENT}"}
REFUSED = [FORGED,
           {**FORGED, "X-Forwarded-Client-Cert": f"By=spiffe://elsewhere/sa/agent;{CLIENT}"},
           {**FORGED, "X-Forwarded-Client-Cert": f"By={PROXY_ID}"},  # no client certificate
           {**FORGED, "X-Forwarded-Client-Cert": f'By={PROXY_ID};URI="unterminated'},
           # the agent appends its own element after the proxy's: the last one is what counts
           {**FORGED, "X-Forwarded-Client-Cert": f"By={PROXY_ID};{CLIENT},By=spiffe://agent;URI=x"}]


async def test_xfcc_is_believed_only_from_the_trusted_proxy(proxy_deps):
    settings = {**proxy_deps, "identity.mode": "headers", "identity.agent_id": "agent-under-test",
                "identity.headers.xfcc_trusted_proxies": [TRUSTED], "identity.headers.xfcc_proxy_ids": [PROXY_ID]}
    async with running_stack(settings) as stack:
        for headers in [*REFUSED, GOOD]:  # the test client connects from 127.0.0.1: not the trusted proxy
            status, env = await stack.call("get_order", {"order_id": "ord_2001"}, headers=headers)
            assert status == 401 and env["error"]["code"] == "unauthorized", (headers, env)
        assert not stack.backend.requests


def test_xfcc_from_the_trusted_proxys_address_is_believed():
    """The same proof as the trusted proxy's peer (no second machine in a test: the check itself)."""
    from proxy.config import HeaderIdentityConfig
    from proxy.errors import ProxyError
    from proxy.identity import HopProof
    proof = HopProof(HeaderIdentityConfig(xfcc_trusted_proxies=[TRUSTED], xfcc_proxy_ids=[PROXY_ID]))
    proof.check(GOOD, INSIDE)
    for headers in REFUSED:
        with pytest.raises(ProxyError):
            proof.check(headers, INSIDE)
    with pytest.raises(ProxyError):
        proof.check(GOOD, OUTSIDE)


@pytest.mark.parametrize("trusted", ["127.0.0.1", "127.0.0.6", "10.0.0.0/0", "::1", "0.0.0.0/0", "own"])
def test_a_trusted_xfcc_range_any_process_in_the_pod_connects_from_does_not_start(trusted):
    """Loopback (Istio's sidecar connects from 127.0.0.6), the unspecified address, or the pod's own address:
    the agent connects from there too, so such a range proves no hop."""
    if trusted == "own":
        from proxy.identity import own_addresses
        mine = [a for a in own_addresses() if not a.is_loopback and a.version == 4]
        if not mine:
            pytest.skip("this machine has no IPv4 address besides loopback")
        trusted = str(mine[0])
    result = run_headers_mode({"TOOLPROXY_IDENTITY_HEADERS_XFCC_TRUSTED_PROXIES": trusted,
                               "TOOLPROXY_IDENTITY_HEADERS_XFCC_PROXY_IDS": PROXY_ID})
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "identity.headers.xfcc_trusted_proxies" in result.stderr and "Traceback" not in result.stderr
    assert "any process in the pod" in result.stderr


def test_the_chart_refuses_headers_mode_without_a_hop_proof():
    from tests.support.helm import HelmError, render
    with pytest.raises(HelmError, match="needs a proof of the trusted hop"):
        render(set_values={"proxy.config.identity.mode": "headers"})
    config = [m for m in render(set_values={"proxy.config.identity.mode": "headers", "proxy.hopSecret.secretName": "hop"})
              if m["kind"] == "ConfigMap" and m["metadata"]["name"].endswith("-config")][0]
    assert "proof_secret_file: /etc/toolproxy/hop/secret" in config["data"]["config.yaml"]
    render(set_values={"proxy.config.identity.mode": "headers"},
           set_json={"proxy.config.identity.headers": {"xfcc_trusted_proxies": ["10.0.0.1"],
                                                       "xfcc_proxy_ids": ["spiffe://gw"]}})


async def test_an_identity_header_sent_twice_is_refused(proxy_deps, tmp_path):
    """A second ``X-Auth-Subject`` line behind the mesh's own (with a valid hop proof) would name another
    caller to whichever reader takes the other line: two lines of any identity header are refused."""
    from multidict import CIMultiDict
    body = json.dumps({"call_id": "call_twice", "tool": "get_order", "arguments": {"order_id": "ord_2001"}})
    async with running_stack({**proxy_deps, **mesh_settings(tmp_path)}) as stack:
        for name, second in (("X-Auth-Subject", "mallory"), ("X-Auth-Tenant", "acme"),
                             ("X-Auth-Roles", "admin"), (HOP_HEADER, HOP_SECRET)):
            headers = CIMultiDict(mesh_headers("gina", "globex"))
            headers.add(name, second)
            headers["Content-Type"] = "application/json"
            async with stack.session.post(stack.proxy_url + "/v1/tool-calls", data=body,
                                          headers=headers) as response:
                env = await response.json(content_type=None)
            assert response.status == 401 and env["error"]["code"] == "unauthorized", (name, env)
            assert name in env["error"]["message"]
        assert not stack.backend.requests
        status, env = await stack.call("get_order", {"order_id": "ord_2001"}, headers=mesh_headers("gina", "globex"))
        assert status == 200, env


def test_two_authorization_lines_are_refused():
    """In jwt mode a second ``Authorization`` line is refused the same way (unit-level: no stack needed)."""
    from multidict import CIMultiDict
    from proxy.identity import bearer_token
    from proxy.errors import ProxyError
    headers = CIMultiDict([("Authorization", "Bearer a.b.c"), ("Authorization", "Bearer d.e.f")])
    with pytest.raises(ProxyError) as refused:
        bearer_token(headers)
    assert refused.value.code == "unauthorized"
    assert bearer_token(CIMultiDict([("Authorization", "Bearer a.b.c")])) == "a.b.c"
