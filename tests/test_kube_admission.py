"""The chart on a real Kubernetes API server: `helm install`, then the API server's own admission verdict.

kube-apiserver (with its shipped admission plugins, PodSecurity among them) runs on kine's SQLite store
(tests/support/kube.py). There is no controller-manager and no kubelet, so a Deployment never gets a Pod
by itself: each test reads the Deployment back from the API server, creates the Pod its template
describes, and reads the server's answer (the status and the Status message). helm's exit code says only
that the API server accepted the Deployment, which it does even when Pod Security would refuse its pods.
"""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.helm import CHART, PRODUCTION_VALUES
from tests.support.kube import KineServer, KubeApiServer, kube_binaries
from tests.support.servers import find_binary

EGRESS_GUARD_VALUES = CHART / "ci" / "egress-guard-values.yaml"
CRDS = sorted((CHART.parent.parent / "crd-schemas").glob("*/*.yaml"))  # the ServiceMonitor/PrometheusRule CRDs
SIDECARS = ["toolproxy-opa", "toolproxy"]  # start order: OPA first, then the proxy, then the agent
# The Secrets docs/deploy.md creates before the install (values here: the API server admits what it is given).
PRODUCTION_SECRETS = {
    "toolproxy-redis": {"url": "rediss://redis.data.svc:6380/0", "password": "p" * 32},
    "toolproxy-redis-tls": {"ca.crt": "-----BEGIN CERTIFICATE-----\n"},
    "toolproxy-jwks": {"jwks.json": '{"keys": []}'},
    "toolproxy-approver-jwks": {"jwks.json": '{"keys": []}'},
    "toolproxy-record-mac": {"mac.key": "0" * 64},
    "toolproxy-call-tokens": {"signing-key.pem": "-----BEGIN PRIVATE KEY-----\n"},
}


@pytest.fixture(scope="module")
def api_server(tmp_path_factory):
    kine_binary, apiserver_binary = kube_binaries()
    root = tmp_path_factory.mktemp("kube")
    (root / "kine").mkdir()
    with KineServer(kine_binary, root / "kine") as kine:
        with KubeApiServer(apiserver_binary, kine.url, root / "apiserver") as server:
            # What the production values' monitoring objects need from the cluster: the Prometheus Operator's
            # CRDs, and the namespace Grafana's dashboard sidecar reads (grafanaDashboards.namespace).
            for crd in CRDS:
                status, body = server.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                                              yaml.safe_load(crd.read_text()))
                assert status == 201, (crd.name, body)
            status, body = server.request("POST", "/api/v1/namespaces", {
                "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "monitoring"}})
            assert status == 201, body
            yield server


def create_namespace(server: KubeApiServer, name: str, level: str) -> None:
    status, body = server.request("POST", "/api/v1/namespaces", {
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "labels": {"pod-security.kubernetes.io/enforce": level,
                                              "pod-security.kubernetes.io/enforce-version": "latest"}}})
    assert status == 201, body


def create_secrets(server: KubeApiServer, namespace: str, secrets: dict[str, dict[str, str]]) -> None:
    for name, data in secrets.items():
        status, body = server.request("POST", f"/api/v1/namespaces/{namespace}/secrets", {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
            "data": {key: base64.b64encode(value.encode()).decode() for key, value in data.items()}})
        assert status == 201, body


def helm_install(server: KubeApiServer, tmp_path: Path, release: str, namespace: str, values: list[Path],
                 set_values: dict[str, str] | None = None) -> str:
    args = [find_binary("helm"), "install", release, str(CHART), "--namespace", namespace,
            "--kubeconfig", str(server.kubeconfig(tmp_path / "kubeconfig")), "--timeout", "120s"]
    for path in values:
        args += ["-f", str(path)]
    for key, value in (set_values or {}).items():
        args += ["--set", f"{key}={value}"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HELM_CACHE_HOME": str(tmp_path / "helm-cache"),
           "HELM_CONFIG_HOME": str(tmp_path / "helm-config"), "HELM_DATA_HOME": str(tmp_path / "helm-data")}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stderr


def deployments(server: KubeApiServer, namespace: str) -> list[dict]:
    status, body = server.request("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments")
    assert status == 200, body
    return body["items"]


def create_pod_of(server: KubeApiServer, deployment: dict) -> tuple[int, dict]:
    """Create the Pod a Deployment's template describes, as its ReplicaSet would: the API server's answer."""
    namespace = deployment["metadata"]["namespace"]
    template = deployment["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": deployment["metadata"]["name"] + "-",
                        "labels": template["metadata"].get("labels", {}),
                        "annotations": template["metadata"].get("annotations", {})},
           "spec": template["spec"]}
    return server.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod)


def test_production_values_install_and_every_pod_is_admitted_under_restricted(api_server, tmp_path):
    namespace = "agents"
    create_namespace(api_server, namespace, "restricted")
    create_secrets(api_server, namespace, PRODUCTION_SECRETS)
    warnings = helm_install(api_server, tmp_path, "support", namespace, [PRODUCTION_VALUES])
    assert "would violate PodSecurity" not in warnings, warnings  # the API server's warning on the Deployment
    installed = deployments(api_server, namespace)
    assert [d["metadata"]["name"] for d in installed] == ["support-toolproxy-agent"]
    for deployment in installed:
        status, created = create_pod_of(api_server, deployment)
        assert status == 201, created.get("message", created)
        # Read back what the API server stored: a server that dropped restartPolicy (native sidecars off)
        # would have stored ordinary init containers that never exit.
        status, pod = api_server.request(
            "GET", f"/api/v1/namespaces/{namespace}/pods/{created['metadata']['name']}")
        assert status == 200, pod
        spec = pod["spec"]
        init = {c["name"]: c for c in spec["initContainers"]}
        assert [c["name"] for c in spec["initContainers"]][-2:] == SIDECARS
        for name in SIDECARS:
            assert init[name]["restartPolicy"] == "Always", name
            assert init[name]["startupProbe"]["httpGet"]["path"] in ("/health", "/readyz"), name
        for name, container in init.items():
            if name not in SIDECARS:
                assert "restartPolicy" not in container, name  # run to completion before the sidecars start
        assert [c["name"] for c in spec["containers"]] == ["agent"]
        assert "restartPolicy" not in spec["containers"][0]
        # OPA's socket directory: the proxy's and OPA's, never the agent's.
        socket_mounts = {c["name"] for c in [*spec["initContainers"], *spec["containers"]]
                         for m in c.get("volumeMounts", []) if m["name"] == "toolproxy-opa-socket"}
        assert socket_mounts == set(SIDECARS)


def test_the_egress_guard_is_refused_under_restricted_and_admitted_where_privileged(api_server, tmp_path):
    """The negative check: the same admission path refuses a pod that asks for root and NET_ADMIN."""
    answers = {}
    for namespace, level in (("guarded-restricted", "restricted"), ("guarded-privileged", "privileged")):
        create_namespace(api_server, namespace, level)
        warnings = helm_install(api_server, tmp_path, "guarded", namespace, [EGRESS_GUARD_VALUES])
        (deployment,) = deployments(api_server, namespace)
        answers[level] = create_pod_of(api_server, deployment)
        if level == "restricted":
            # helm exits 0 all the same: the Deployment itself is admitted, with a warning only.
            assert "would violate PodSecurity" in warnings and "restricted:latest" in warnings, warnings
    status, body = answers["restricted"]
    assert status == 403 and body["reason"] == "Forbidden", body
    message = body["message"]
    assert 'violates PodSecurity "restricted:latest"' in message, message
    assert 'container "toolproxy-egress-guard"' in message and "NET_ADMIN" in message, message
    assert answers["privileged"][0] == 201, answers["privileged"][1]

