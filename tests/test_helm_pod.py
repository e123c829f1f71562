"""The rendered pod, run on this machine: real OPA and the real toolproxy entrypoint.

The chart is rendered with `helm template` (free ports, the test's Redis);
tests/support/helm.py's LocalPod writes every mounted ConfigMap in the
kubelet's atomic-writer layout and starts each sidecar with its rendered args
and env (the toolproxy container via the Dockerfile's ENTRYPOINT). So these
tests prove that the paths, ports, probes and OPA flags in the manifest work
together, and that editing the policies ConfigMap changes OPA's answers
without a restart.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from proxy.policy.client import catalog_document
from proxy.registry import load_registry
from tests.support.helm import (REPO, LocalPod, containers, http, http_get, http_unix, one, python_entrypoint, render,
                                wait_until)
from tests.support.calltokens import session_keys
from tests.support.metrics import exported_names
from tests.support.promql import metric_names
from tests.support.servers import find_binary, free_port, mac_key_file

START_TIMEOUT = 30.0
WATCH_TIMEOUT = 15.0
# The chart's OPA admits the proxy's token only; this second token (TOOLPROXY_OPA_ADMIN_TOKEN, never set by the
# chart) is the test's own, given to the OPA process here so the tests can look at policies and data.
TEST_OPA_TOKEN = "test-inspection-token"
ADMIN = {"Authorization": f"Bearer {TEST_OPA_TOKEN}"}


class RunningPod:
    def __init__(self, local: LocalPod, manifests: list[dict]) -> None:
        self.local, self.manifests = local, manifests
        spec = local.pod_spec
        self.ports = {p["name"]: p["containerPort"] for c in containers(spec).values() for p in c.get("ports", [])}
        config_name = next(v["configMap"]["name"] for v in spec["volumes"] if v["name"] == "toolproxy-config")
        self.config = yaml.safe_load(local.configmaps[config_name]["config.yaml"])
        # OPA's decision API: the Unix socket in the emptyDir the proxy and OPA share, at its host path.
        self.opa_socket = local.translate("toolproxy", self.config["opa"]["url"]).removeprefix("unix://")
        self.agent_env = local.env("agent")
        token = Path(local.translate("toolproxy", self.config["opa"]["token_file"])).read_text()
        self.proxy_token = {"Authorization": f"Bearer {token}"}  # what the toolproxy container sends

    def opa(self, method: str, path: str, body: bytes | None = None, **kwargs) -> tuple[int, bytes]:
        """A request to OPA's decision API over its socket (what the proxy reaches, and nothing else)."""
        return http_unix(self.opa_socket, method, path, body, **kwargs)

    def probe(self, container: str, kind: str) -> tuple[int, bytes]:
        get = containers(self.local.pod_spec)[container][kind]["httpGet"]
        port = get["port"] if isinstance(get["port"], int) else self.ports[get["port"]]
        return http_get(f"http://127.0.0.1:{port}{get['path']}")

    def policies_configmap(self) -> str:
        return next(v["configMap"]["name"] for v in self.local.pod_spec["volumes"] if v["name"] == "toolproxy-policies")


@pytest.fixture(scope="module")
def demo_backend(tmp_path_factory):
    """examples/demo_backend.py as its own process: the tool backend the demo registry calls."""
    tmp_path = tmp_path_factory.mktemp("demo-backend")
    port = free_port()
    log = open(tmp_path / "demo-backend.log", "wb")
    # It verifies the call tokens of the key the pod's proxy mounts from its Secret (below).
    proc = subprocess.Popen([sys.executable, "-m", "examples.demo_backend", "--port", str(port),
                             "--jwks-file", str(session_keys().jwks_file)], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: http_get(url + "/healthz")[0] == 200, START_TIMEOUT, "demo backend",
                   proc, lambda: (tmp_path / "demo-backend.log").read_text())
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@pytest.fixture(scope="module")
def pod(tmp_path_factory, redis_server, demo_backend):
    """One running pod for the module (tests that edit a ConfigMap put it back)."""
    tmp_path = tmp_path_factory.mktemp("pod")
    if not redis_server.running:  # a test elsewhere stopped it
        redis_server.start()
    redis_url = redis_server.url
    ports = {key: free_port() for key in ("proxy.ports.agent", "proxy.ports.admin", "proxy.ports.ops",
                                          "opa.diagnosticPort")}
    # The pod simulation has no token issuer: opt into the fixed demo caller (the chart default is jwt).
    # The session Redis has no password: the escape hatch, as a throwaway cluster would use it.
    manifests = render([], set_values={**ports, "proxy.redis.url": redis_url, "proxy.backends.demo": demo_backend,
                                       "proxy.config.identity.mode": "static", "proxy.redis.allowUnauthenticated": "true",
                                       # This pod runs as processes of this host, in the host's network namespace:
                                       # the egress guard would load its rules there (tests/walkaround tests it).
                                       "egressGuard.enabled": "false",
                                       "proxy.callTokens.secretName": "toolproxy-call-tokens",
                                       "proxy.callTokens.keyId": session_keys().kid,
                                       "proxy.integrity.macKeySecret.name": "toolproxy-record-mac"},
                       set_json={"proxy.callTokens.jwks": session_keys().jwks})
    spec = one(manifests, "Deployment", "-agent")["spec"]["template"]["spec"]
    local = LocalPod(manifests, spec, tmp_path / "pod", secrets={
        "toolproxy-call-tokens": {"signing-key.pem": session_keys().key_file.read_text()},
        "toolproxy-record-mac": {"mac.key": Path(mac_key_file()).read_text()}})
    running = RunningPod(local, manifests)
    try:
        local.run_init_containers({"toolproxy-opa-catalog": python_entrypoint()})
        opa = local.start("toolproxy-opa", [find_binary("opa")], extra_env={"TOOLPROXY_OPA_ADMIN_TOKEN": TEST_OPA_TOKEN})
        wait_until(lambda: running.probe("toolproxy-opa", "readinessProbe")[0] == 200, START_TIMEOUT,
                   "OPA readiness probe", opa, lambda: local.log("toolproxy-opa"))
        proxy = local.start("toolproxy", python_entrypoint(), translate_files=[proxy_config_path(spec)])
        wait_until(lambda: running.probe("toolproxy", "readinessProbe")[0] == 200, START_TIMEOUT,
                   "toolproxy readiness probe", proxy, lambda: local.log("toolproxy"))
        yield running
    finally:
        local.stop()


def proxy_config_path(spec) -> str:
    args = containers(spec)["toolproxy"]["args"]
    return args[args.index("--config") + 1]


def test_every_probe_of_both_sidecars_answers(pod):
    for container, kinds in (("toolproxy", ("livenessProbe", "readinessProbe", "startupProbe")),
                             ("toolproxy-opa", ("livenessProbe", "readinessProbe", "startupProbe"))):
        for kind in kinds:
            status, body = pod.probe(container, kind)
            assert status == 200, (container, kind, body)


def test_agent_container_reaches_the_proxy_at_its_env_url(pod):
    status, body = http_get(pod.agent_env["TOOLPROXY_URL"] + "/v1/tools")
    assert status == 200, body
    listed = {t["name"] for t in json.loads(body)["tools"]}
    registry_cm = next(v["configMap"]["name"] for v in pod.local.pod_spec["volumes"]
                       if v["name"] == "toolproxy-registry")
    declared = {t["name"] for text in pod.local.configmaps[registry_cm].values()
                for t in yaml.safe_load(text)["tools"]}
    assert listed and listed <= declared


def call_tool(pod, call_id: str) -> tuple[int, dict]:
    body = {"call_id": call_id, "tool": "get_order", "arguments": {"order_id": "ord_1001"}}
    status, raw = http("POST", pod.agent_env["TOOLPROXY_URL"] + "/v1/tool-calls", json.dumps(body).encode(),
                       timeout=10)
    return status, json.loads(raw)


def test_opa_holds_the_catalog_of_the_registry_the_proxy_serves(pod):
    """The init container's `toolproxy opa-data` output: same digest as the proxy's own registry."""
    registry_dir = pod.local.volume_dir("toolproxy-registry")
    expected = catalog_document(load_registry([registry_dir]))["digest"]
    status, body = pod.opa("GET", "/v1/data/toolproxy/catalog/digest", headers=ADMIN)
    assert status == 200 and json.loads(body)["result"] == expected


def test_a_tool_call_is_decided_by_the_opa_sidecar_and_a_policies_configmap_edit_flips_it(pod):
    status, envelope = call_tool(pod, "call_1")
    assert status == 200 and envelope["outcome"] == "succeeded", envelope
    name = pod.policies_configmap()
    original = dict(pod.local.configmaps[name])
    processes = {c: pod.local.processes[c] for c in ("toolproxy", "toolproxy-opa")}
    pod.local.update_configmap(name, {**original, "chart_probe.rego":
                                      'package toolproxy.tools\n\ndeny contains "chart_probe" if input.action == "call"\n'})
    denied = wait_until(lambda: (lambda r: r if r[0] == 403 else None)(call_tool(pod, "call_2")), WATCH_TIMEOUT,
                        "the edited policies deny the call")
    assert denied[1]["error"]["code"] == "forbidden" and denied[1]["side_effect"]["attempted"] is False
    pod.local.update_configmap(name, original)
    wait_until(lambda: call_tool(pod, "call_3")[0] == 200, WATCH_TIMEOUT, "the restored policies allow it again")
    assert all(proc.poll() is None for proc in processes.values()), "no sidecar was restarted"


def test_opa_answers_the_proxys_token_on_the_decision_path_only(pod):
    """Issue 28: from the agent container (no token) every read, decision and write is 401; the proxy's token
    asks decisions and nothing else."""
    decision = "/v1/data/" + pod.config["opa"]["decision_path"]
    for headers in ({}, pod.proxy_token):
        assert pod.opa("PUT", "/v1/policies/evil", b"package evil\n", content_type="text/plain",
                       headers=headers)[0] == 401
        assert pod.opa("PUT", "/v1/data/toolproxy/catalog", b"{}", headers=headers)[0] == 401
        assert pod.opa("GET", "/v1/policies", headers=headers)[0] == 401
        assert pod.opa("GET", "/v1/data/toolproxy", headers=headers)[0] == 401  # every tenant's data
    assert pod.opa("POST", decision, b'{"input": {}}')[0] == 401
    status, body = pod.opa("POST", decision, b'{"input": {}}', headers=pod.proxy_token)
    assert status == 200 and "result" in json.loads(body), body


def test_editing_the_policies_configmap_changes_answers_without_a_restart(pod):
    name = pod.policies_configmap()
    original = dict(pod.local.configmaps[name])
    opa = pod.local.processes["toolproxy-opa"]
    def answer():
        status, body = pod.opa("POST", "/v1/data/toolproxy/chart_probe/answer", b'{"input": {}}', headers=ADMIN)
        assert status == 200, body
        return json.loads(body).get("result")

    assert answer() is None
    for value in ("first", "second"):
        pod.local.update_configmap(name, {**original, "chart_probe.rego":
                                          f'package toolproxy.chart_probe\n\nanswer := "{value}"\n'})
        wait_until(lambda: answer() == value, WATCH_TIMEOUT, f"OPA sees the edited ConfigMap ({value})")
    # A file that does not compile is refused; the previous policies keep answering.
    pod.local.update_configmap(name, {**original, "chart_probe.rego": 'package toolproxy.chart_probe\n\nanswer := \n'})
    wait_until(lambda: "chart_probe.rego" in pod.local.log("toolproxy-opa"), WATCH_TIMEOUT,
               "OPA reports the broken file")
    assert answer() == "second"
    pod.local.update_configmap(name, original)  # a removed key disappears too
    wait_until(lambda: answer() is None, WATCH_TIMEOUT, "OPA drops the removed file")
    assert opa.poll() is None and pod.local.processes["toolproxy-opa"] is opa, "OPA was not restarted"
    assert pod.probe("toolproxy-opa", "readinessProbe")[0] == 200


def test_prometheus_rules_reference_only_metrics_the_running_proxy_exports(pod):
    """The chart's PrometheusRule, checked against this pod's live /metrics (the ops port the ServiceMonitor scrapes)."""
    status, body = http_get(f"http://127.0.0.1:{pod.ports['tp-ops']}/metrics")
    assert status == 200, body
    exported = exported_names(body.decode())
    rule = one(render(set_values={"prometheusRule.enabled": "true"}), "PrometheusRule")
    exprs = [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]
    assert exprs
    for expr in exprs:
        names = metric_names(str(expr))
        assert names and not names - exported, f"{expr!r} uses {names - exported}, not in the proxy's /metrics"


# ---------------------------------------------------------------------------
# Bundle mode: OPA pulls the policies with the rendered OPA config
# ---------------------------------------------------------------------------

class _BundleServer:
    """Serves one bundle file to requests that carry the expected bearer token."""

    def __init__(self, bundle: bytes, resource: str, token: str) -> None:
        self.requests: list[tuple[str, str | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server API)
                auth = self.headers.get("Authorization")
                outer.requests.append((self.path, auth))
                if auth != f"Bearer {token}":
                    self.send_response(401)
                    self.end_headers()
                    return
                if self.path != "/" + resource:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/gzip")
                self.end_headers()
                self.wfile.write(bundle)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def test_bundle_mode_opa_pulls_the_policies_with_the_rendered_config(tmp_path):
    source = tmp_path / "bundle-src"
    source.mkdir()
    (source / "chart_probe.rego").write_text('package toolproxy.chart_probe\n\nanswer := "from-bundle"\n')
    (source / ".manifest").write_text(json.dumps({"roots": ["toolproxy"], "revision": "r1"}))
    bundle = tmp_path / "bundle.tar.gz"
    subprocess.run([find_binary("opa"), "build", "-b", str(source), "-o", str(bundle)], check=True,
                   capture_output=True, timeout=60)
    resource = "bundles/toolproxy.tar.gz"
    with _BundleServer(bundle.read_bytes(), resource, token="bundle-s3cret") as server:
        manifests = render(set_values={"opa.policySource": "bundle", "opa.bundle.serviceUrl": server.url,
                                       "opa.bundle.resource": resource, "opa.bundle.tokenSecret.name": "bundle-token",
                                       "opa.diagnosticPort": free_port()},
                           set_json={"networkPolicy.opaBundle.to": [{"ipBlock": {"cidr": "127.0.0.1/32"}}]})
        spec = one(manifests, "Deployment", "-agent")["spec"]["template"]["spec"]
        local = LocalPod(manifests, spec, tmp_path / "pod", secrets={
            "bundle-token": {"token": "bundle-s3cret"}, "toolproxy-record-mac": {"mac.key": "0" * 64},
            "toolproxy-call-tokens": {"signing-key.pem": session_keys().key_file.read_text()}})
        running = RunningPod(local, manifests)
        opa_args = containers(spec)["toolproxy-opa"]["args"]
        opa_config = next(a.split("=", 1)[1] for a in opa_args if a.startswith("--config-file="))
        try:
            # The OPA config names the mounted token file: give OPA the host path of that mount.
            opa = local.start("toolproxy-opa", [find_binary("opa")], translate_files=[opa_config],
                              extra_env={"TOOLPROXY_OPA_ADMIN_TOKEN": TEST_OPA_TOKEN})
            # Readiness is /health?bundles: it turns 200 only once the bundle is active.
            wait_until(lambda: running.probe("toolproxy-opa", "readinessProbe")[0] == 200, START_TIMEOUT,
                       "OPA bundle readiness", opa, lambda: local.log("toolproxy-opa"))
            status, body = running.opa("POST", "/v1/data/toolproxy/chart_probe/answer", b'{"input": {}}',
                                       headers=ADMIN)
            assert status == 200 and json.loads(body)["result"] == "from-bundle"
            # The API authorization policy outside the bundle's roots is still in force.
            assert running.opa("PUT", "/v1/policies/evil", b"package evil\n", content_type="text/plain")[0] == 401
            assert server.requests and all(auth == "Bearer bundle-s3cret" for _, auth in server.requests)
        finally:
            local.stop()
