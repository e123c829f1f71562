"""The Helm chart, rendered by the real `helm template` and read as YAML.

Static checks over the manifests (sidecars, probes, resources, securityContext,
mounts against what the containers read, NetworkPolicy, Services, schema
refusals, the named templates from a team's own chart, the Dockerfile). The
containers themselves are run from the rendered pod in test_helm_pod.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from proxy.config import describe, load_config, serving_problem
from proxy.registry import load_registry
from tests.support.helm import (CHART, PRODUCTION_VALUES, MINIMAL_VALUES, HelmError, LocalPod, containers, dockerfile_stages,
                                entrypoint, find, helm, native_sidecars, one, render)
from tests.support.stack import REPO

HARDENED = {"runAsNonRoot": True, "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False}
SIDECARS = ("toolproxy", "toolproxy-opa")
# The pod's long-running containers in the order the kubelet starts them: OPA, the proxy (native sidecars),
# then the agent.
RUNNING = ["toolproxy-opa", "toolproxy", "agent"]
DEMO_SECRETS = {"toolproxy-redis": {"url": "rediss://redis.data.svc:6380/0", "password": "pw"},
                "toolproxy-redis-tls": {"ca.crt": "CA"}, "toolproxy-jwks": {"jwks.json": "{\"keys\": []}"},
                "toolproxy-approver-jwks": {"jwks.json": "{\"keys\": []}"},
                "toolproxy-record-mac": {"mac.key": "0" * 64},
                "toolproxy-call-tokens": {"signing-key.pem": "PEM"}}
PUBLIC_JWK = {"kty": "OKP", "crv": "Ed25519", "x": "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo", "kid": "2026-02"}
# The two fleet keys every release names (what ci/minimal-values.yaml gives), for renders without a values file.
FLEET_KEYS = {"proxy.integrity.macKeySecret.name": "toolproxy-record-mac",
              "proxy.callTokens.secretName": "toolproxy-call-tokens", "proxy.callTokens.jwks": {"keys": [PUBLIC_JWK]}}


@pytest.fixture(scope="module")
def default():
    return render()


@pytest.fixture(scope="module")
def demo():
    return render([PRODUCTION_VALUES])


@pytest.fixture(params=["default", "demo"])
def rendered(request, default, demo):
    return {"default": default, "demo": demo}[request.param]


def agent_pod(manifests):
    return one(manifests, "Deployment", "-agent")["spec"]["template"]


def mounts(container):
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def configmap_of(manifests, pod_spec, volume_name):
    volume = next(v for v in pod_spec["volumes"] if v["name"] == volume_name)
    return one(manifests, "ConfigMap", volume["configMap"]["name"])


# ---------------------------------------------------------------------------
# helm lint / template
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("values", [[MINIMAL_VALUES], [PRODUCTION_VALUES]], ids=["minimal", "demo"])
def test_helm_lint_passes(values):
    args = ["lint", str(CHART)] + [a for v in values for a in ("-f", str(v))]
    out = helm(*args).stdout
    assert "0 chart(s) failed" in out


def test_default_and_demo_render_the_complete_example(rendered):
    kinds = sorted(m["kind"] for m in rendered)
    for kind in ("Deployment", "ConfigMap", "Service", "NetworkPolicy", "ServiceAccount"):
        assert kind in kinds
    pod = agent_pod(rendered)
    assert list(containers(pod["spec"])) == RUNNING
    agent_env = {e["name"]: e.get("value") for e in containers(pod["spec"])["agent"]["env"]}
    assert agent_env["TOOLPROXY_URL"] == "http://127.0.0.1:8787"


def test_names_fit_kubernetes_limits(rendered):
    """No cluster here to refuse them: port names are IANA service names, object names DNS labels."""
    for manifest in rendered:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", manifest["metadata"]["name"]), manifest
    pod = agent_pod(rendered)["spec"]
    every = [*pod["initContainers"], *pod["containers"]]
    names = [p["name"] for c in every for p in c.get("ports", [])]
    assert len(names) == len(set(names))
    for name in names:
        assert len(name) <= 15 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and re.search("[a-z]", name)
    volumes = [v["name"] for v in pod["volumes"]]
    assert len(volumes) == len(set(volumes))
    for container in every:
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, (container["name"], mount)


# ---------------------------------------------------------------------------
# Sidecars: probes, resources, securityContext
# ---------------------------------------------------------------------------

def test_both_sidecars_have_probes_on_their_health_endpoints(rendered):
    pod = agent_pod(rendered)["spec"]
    proxy, opa = (containers(pod)[n] for n in SIDECARS)
    ports = {p["name"]: p["containerPort"] for c in (proxy, opa) for p in c["ports"]}
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "tp-ops"}
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "tp-ops"}
    # The startup probes gate the next container's start (native sidecars): the proxy's waits for /readyz.
    assert proxy["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "tp-ops"}
    assert opa["startupProbe"]["httpGet"] == {"path": "/health", "port": "opa-diag"}
    assert opa["livenessProbe"]["httpGet"]["port"] == opa["readinessProbe"]["httpGet"]["port"] == "opa-diag"
    assert opa["readinessProbe"]["httpGet"]["path"].startswith("/health")
    config = yaml.safe_load(configmap_of(rendered, pod, "toolproxy-config")["data"]["config.yaml"])
    # The probe port is the ops listener, bound where the kubelet can reach it.
    assert ports["tp-ops"] == config["ops"]["port"] and config["ops"]["host"] == "0.0.0.0"
    assert f"--diagnostic-addr=0.0.0.0:{ports['opa-diag']}" in opa["args"]
    for container in (proxy, opa):
        for probe in ("livenessProbe", "readinessProbe"):
            assert container[probe]["periodSeconds"] >= 1 and container[probe]["failureThreshold"] >= 1


def test_the_sidecars_are_native_sidecars_that_start_before_the_agent_opa_first(rendered):
    """Init containers with restartPolicy: Always, after the run-to-completion ones: the kubelet starts OPA,
    then the proxy once OPA's startup probe passes, then the agent once the proxy's does; it stops them in
    the reverse order. The agent is an ordinary container."""
    pod = agent_pod(rendered)["spec"]
    init = [c["name"] for c in pod["initContainers"]]
    assert [c["name"] for c in native_sidecars(pod)] == ["toolproxy-opa", "toolproxy"] == init[-2:]
    for container in native_sidecars(pod):
        assert container["startupProbe"]["httpGet"], container["name"]
    assert all("restartPolicy" not in c for c in pod["initContainers"][:-2])
    assert [c["name"] for c in pod["containers"]] == ["agent"] and "restartPolicy" not in pod["containers"][0]


RESTRICTED_CAPABILITIES = {"NET_BIND_SERVICE"}


def test_every_container_meets_pod_security_restricted(rendered):
    """The "restricted" profile's container rules, read statically (tests/test_kube_admission.py asks a real
    API server): every container, init and sidecar and the example agent."""
    pod = agent_pod(rendered)["spec"]
    pod_sc = pod.get("securityContext", {})
    assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert all(set(v) & {"configMap", "secret", "emptyDir", "projected", "downwardAPI"} for v in pod["volumes"])
    for container in [*pod["initContainers"], *pod["containers"]]:
        sc, name = container["securityContext"], container["name"]
        assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, name
        assert sc.get("runAsUser", pod_sc.get("runAsUser", 1)) != 0, name
        assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged"), name
        assert "ALL" in sc["capabilities"]["drop"], name
        assert set(sc["capabilities"].get("add", [])) <= RESTRICTED_CAPABILITIES, name
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
        assert seccomp.get("type") in ("RuntimeDefault", "Localhost"), name
        assert not any(port.get("hostPort") for port in container.get("ports", [])), name


def test_the_egress_guard_mode_renders_the_guard_first_and_only_for_a_privileged_namespace():
    values = [MINIMAL_VALUES, CHART / "ci" / "egress-guard-values.yaml"]
    pod = agent_pod(render(values))["spec"]
    guard = pod["initContainers"][0]
    assert guard["name"] == "toolproxy-egress-guard"
    assert guard["securityContext"]["capabilities"]["add"] == ["NET_ADMIN"] and guard["securityContext"]["runAsUser"] == 0
    # Default-deny for every UID but the proxy's: the agent may reach the proxy's agent port, DNS and the allow-list.
    proxy = containers(pod)["toolproxy"]
    assert guard["args"] == ["egress-rules", "--uid", str(proxy["securityContext"]["runAsUser"]), "--agent-port", "8787",
                             "--apply"]
    bundle = agent_pod(render(values, set_values={"opa.policySource": "bundle", "opa.bundle.serviceUrl": "https://b",
                                                  "networkPolicy.enabled": "false"},
                              set_json={"egressGuard.allow": ["203.0.113.0/24:443"], "egressGuard.dns": ["10.96.0.10/32"]}))
    args = bundle["spec"]["initContainers"][0]["args"]
    opa_uid = containers(bundle["spec"])["toolproxy-opa"]["securityContext"]["runAsUser"]
    assert args[args.index("--allow") + 1] == "203.0.113.0/24:443" and args[args.index("--dns") + 1] == "10.96.0.10/32"
    assert [args[i + 1] for i, a in enumerate(args) if a == "--uid"] == [str(proxy["securityContext"]["runAsUser"]),
                                                                         str(opa_uid)], "OPA fetches its bundles"
    with pytest.raises(HelmError, match="/egressGuard/allow/0"):
        render(values, set_json={"egressGuard.allow": ["api.example.com:443"]})  # a name would be resolved once
    with pytest.raises(HelmError, match="/podSecurityLevel"):
        render(values, set_values={"podSecurityLevel": "restricted"})


def test_opa_listens_on_a_unix_socket_that_only_the_proxy_and_opa_mount(rendered):
    pod = agent_pod(rendered)["spec"]
    opa, proxy = containers(pod)["toolproxy-opa"], containers(pod)["toolproxy"]
    volume = next(v for v in pod["volumes"] if v["name"] == "toolproxy-opa-socket")
    assert "emptyDir" in volume
    holders = {c["name"] for c in [*pod["initContainers"], *pod["containers"]]
               if "toolproxy-opa-socket" in mounts(c).values()}
    assert holders == set(SIDECARS)
    socket_dir = next(p for p, v in mounts(opa).items() if v == "toolproxy-opa-socket")
    assert mounts(proxy)[socket_dir] == "toolproxy-opa-socket"
    assert f"--addr=unix://{socket_dir}/opa.sock" in opa["args"]
    assert not [a for a in opa["args"] if a.startswith("--addr=") and "unix://" not in a], "no TCP decision API"
    config = yaml.safe_load(configmap_of(rendered, pod, "toolproxy-config")["data"]["config.yaml"])
    assert config["opa"]["url"] == f"unix://{socket_dir}/opa.sock" and "allow_tcp" not in config["opa"]


def test_opa_over_tcp_needs_the_named_escape_hatch(tmp_path):
    manifests = render(set_values={"opa.allowTcp": "true", "opa.port": 8181})
    pod = agent_pod(manifests)["spec"]
    opa = containers(pod)["toolproxy-opa"]
    assert "--addr=127.0.0.1:8181" in opa["args"] and "toolproxy-opa-socket" not in mounts(opa).values()
    config = yaml.safe_load(configmap_of(manifests, pod, "toolproxy-config")["data"]["config.yaml"])
    assert config["opa"]["url"] == "http://127.0.0.1:8181" and config["opa"]["allow_tcp"] is True
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump({**config, "integrity": {}, "call_tokens": {}}))
    loaded = load_config(config_file, env={"TOOLPROXY_REDIS_PASSWORD": "pw"})  # the env from the Redis Secret
    assert loaded.opa.allow_tcp and loaded.opa.socket_path is None
    # The chart owns the address: a TCP URL given through proxy.config is refused.
    for key in ("proxy.config.opa.url", "proxy.config.opa.allow_tcp"):
        with pytest.raises(HelmError, match="opa.allowTcp=true is the escape hatch"):
            render(set_values={key: "http://127.0.0.1:8181" if key.endswith("url") else "true"})


def test_the_drain_budget_is_rendered_and_fits_the_grace_period(rendered):
    pod = agent_pod(rendered)["spec"]
    config = yaml.safe_load(configmap_of(rendered, pod, "toolproxy-config")["data"]["config.yaml"])
    drain_ms = config["shutdown"]["drain_timeout_ms"]
    assert drain_ms == 20000 and pod["terminationGracePeriodSeconds"] * 1000 >= drain_ms + 5000
    with pytest.raises(HelmError, match=re.escape("must be at least proxy.drainSeconds + 5 (65)")):
        render(set_values={"proxy.drainSeconds": 60})
    assert "terminationGracePeriodSeconds" in str(agent_pod(render(set_values={
        "proxy.drainSeconds": 60, "agent.terminationGracePeriodSeconds": 70}))["spec"])


def test_both_sidecars_have_resources_and_a_restrictive_security_context(rendered):
    pod = agent_pod(rendered)["spec"]
    for name in SIDECARS:
        container = containers(pod)[name]
        resources = container["resources"]
        assert set(resources["requests"]) >= {"cpu", "memory"} and "memory" in resources["limits"], name
        sc = container["securityContext"]
        assert {k: sc.get(k) for k in HARDENED} == HARDENED, name
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], name
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert sc["runAsUser"] > 0, name
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # The agent cannot see the sidecars' processes or environment, nor use a Kubernetes token.
    assert pod["shareProcessNamespace"] is False and pod["automountServiceAccountToken"] is False


def test_proxy_user_matches_the_dockerfile_user(default):
    proxy = containers(agent_pod(default)["spec"])["toolproxy"]
    user = [rest for ins, rest in dockerfile_stages()[-1] if ins == "USER"][-1]
    assert f"{proxy['securityContext']['runAsUser']}:{proxy['securityContext']['runAsGroup']}" == user


# ---------------------------------------------------------------------------
# Mounts: what the containers read is where the ConfigMaps are mounted
# ---------------------------------------------------------------------------

def test_proxy_reads_its_config_and_registry_from_the_mounted_configmaps(rendered, tmp_path):
    pod = agent_pod(rendered)["spec"]
    proxy = containers(pod)["toolproxy"]
    config_path = proxy["args"][proxy["args"].index("--config") + 1]
    assert mounts(proxy)[str(Path(config_path).parent)] == "toolproxy-config"
    config_map = configmap_of(rendered, pod, "toolproxy-config")
    assert Path(config_path).name in config_map["data"]
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    registry_mount = next(p for p, v in mounts(proxy).items() if v == "toolproxy-registry")
    assert config["registry"]["paths"] == [registry_mount]
    # The registry ConfigMap holds contracts the proxy accepts (kubelet layout, as mounted).
    local = LocalPod(rendered, pod, tmp_path, secrets=DEMO_SECRETS)
    registry = load_registry([local.volume_dir("toolproxy-registry")])
    assert len(registry) > 0


def test_rendered_config_and_env_are_accepted_by_the_proxy(rendered, tmp_path):
    """Every key the chart writes is a real setting of the right type (config.py refuses unknown keys)."""
    pod = agent_pod(rendered)["spec"]
    local = LocalPod(rendered, pod, tmp_path, secrets=DEMO_SECRETS)
    config_file = local.volume_dir("toolproxy-config") / "config.yaml"
    env = local.env("toolproxy")
    assert all(name.startswith("TOOLPROXY_") for name in env)
    known = {row[1] for row in describe()}
    assert set(env) <= known, set(env) - known
    config = load_config(config_file, env=env)
    assert config.identity.agent_id == pod["serviceAccountName"]
    assert config.listen.host == "127.0.0.1"
    opa_addr = next(a for a in containers(pod)["toolproxy-opa"]["args"] if a.startswith("--addr="))
    assert config.opa.url == opa_addr.removeprefix("--addr=") and config.opa.socket_path
    # Nothing `toolproxy run` refuses: both fleet keys are set, and OPA is on its socket.
    assert serving_problem(config) is None


def test_opa_loads_policies_and_data_from_the_mounted_configmaps(rendered):
    pod = agent_pod(rendered)["spec"]
    opa = containers(pod)["toolproxy-opa"]
    mounted = mounts(opa)
    loaded = [a for a in opa["args"] if not a.startswith("-") and a not in ("run",)]
    policies = next(p for p, v in mounted.items() if v == "toolproxy-policies")
    assert policies in loaded and "--watch" in opa["args"]
    # Hidden ..data / ..<timestamp> directories of ConfigMap volumes must not be loaded twice.
    assert "--ignore=.*" in opa["args"]
    for path in loaded:
        assert path.rsplit(":", 1)[-1] in mounted, f"OPA loads {path}, which is not mounted"
    rego = configmap_of(rendered, pod, "toolproxy-policies")["data"]
    assert rego and all(name.endswith(".rego") and not name.endswith("_test.rego") for name in rego)


def test_the_catalog_init_container_feeds_opa_from_the_mounted_registry(rendered):
    pod = agent_pod(rendered)["spec"]
    init = {c["name"]: c for c in pod["initContainers"]}["toolproxy-opa-catalog"]
    proxy, opa = containers(pod)["toolproxy"], containers(pod)["toolproxy-opa"]
    assert init["image"] == proxy["image"]
    sc = init["securityContext"]
    assert {k: sc.get(k) for k in HARDENED} == HARDENED and sc["capabilities"]["drop"] == ["ALL"]
    assert set(init["resources"]["limits"]) >= {"memory"}
    script, registry, out_dir = init["args"]
    assert "opa-data --registry" in script and mounts(init)[registry] == "toolproxy-registry"
    assert mounts(init)[out_dir] == "toolproxy-opa-catalog" and mounts(opa)[out_dir] == "toolproxy-opa-catalog"
    assert f"toolproxy.catalog:{out_dir}" in opa["args"]
    volume = next(v for v in pod["volumes"] if v["name"] == "toolproxy-opa-catalog")
    assert "emptyDir" in volume
    config = yaml.safe_load(configmap_of(rendered, pod, "toolproxy-config")["data"]["config.yaml"])
    assert config["opa"]["push_catalog"] is False, "OPA refuses writes: the proxy must not try to push"


def test_catalog_given_as_data_replaces_the_init_container():
    catalog = {"digest": "d" * 64, "tools": {}}
    manifests = render(set_json={"opa.catalog.data": catalog})
    pod = agent_pod(manifests)["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["toolproxy-opa", "toolproxy"]
    data = configmap_of(manifests, pod, "toolproxy-opa-catalog")["data"]
    assert json.loads(data["catalog.json"]) == catalog


def test_demo_redis_tls_password_and_jwks_come_from_secrets_into_the_proxy_only(demo):
    pod = agent_pod(demo)["spec"]
    proxy, opa, agent = containers(pod)["toolproxy"], containers(pod)["toolproxy-opa"], containers(pod)["agent"]
    env = {e["name"]: e for e in proxy["env"]}
    assert env["TOOLPROXY_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "toolproxy-redis", "key": "url"}
    assert env["TOOLPROXY_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "toolproxy-redis",
                                                                             "key": "password"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["toolproxy-redis-tls"]["secret"]["secretName"] == "toolproxy-redis-tls"
    assert volumes["toolproxy-jwks"]["secret"]["secretName"] == "toolproxy-jwks"
    config = yaml.safe_load(configmap_of(demo, pod, "toolproxy-config")["data"]["config.yaml"])
    tls_mount = next(p for p, v in mounts(proxy).items() if v == "toolproxy-redis-tls")
    assert config["redis"]["tls_ca_file"] == f"{tls_mount}/ca.crt"
    # Caller keys and approver keys: separate Secrets, each wired to its own jwt section.
    for section, volume, secret in (("identity", "toolproxy-jwks", "toolproxy-jwks"),
                                    ("admin_identity", "toolproxy-admin-jwks", "toolproxy-approver-jwks")):
        jwks_file = Path(config[section]["jwt"]["jwks_file"])
        assert mounts(proxy)[str(jwks_file.parent)] == volume
        assert volumes[volume]["secret"]["secretName"] == secret
        assert [i["path"] for i in volumes[volume]["secret"]["items"]] == [jwks_file.name]
    assert config["identity"]["mode"] == config["admin_identity"]["mode"] == "jwt"
    for other in (opa, agent):
        names = {m["name"] for m in other.get("volumeMounts", [])}
        assert not names & {"toolproxy-redis-tls", "toolproxy-jwks", "toolproxy-admin-jwks", "toolproxy-config",
                            "toolproxy-record-mac", "toolproxy-opa-token"}, other["name"]
    # OPA gets exactly one secret: the bearer token it admits; the agent none.
    assert [e["name"] for e in opa.get("env", []) if "valueFrom" in e] == ["TOOLPROXY_OPA_TOKEN"]
    assert not [e for e in agent.get("env", []) if "valueFrom" in e]


def test_secrets_are_mounted_in_their_containers_only(rendered):
    """Issue 28: the record MAC key in the proxy only; OPA's token in the proxy (a file) and OPA (its env)."""
    pod = agent_pod(rendered)["spec"]
    proxy, opa, agent = containers(pod)["toolproxy"], containers(pod)["toolproxy-opa"], containers(pod)["agent"]
    config = yaml.safe_load(configmap_of(rendered, pod, "toolproxy-config")["data"]["config.yaml"])
    assert Path(config["integrity"]["mac_key_file"]).parent.as_posix() in mounts(proxy)
    assert Path(config["opa"]["token_file"]).parent.as_posix() in mounts(proxy)
    assert config["redis"].get("username", "toolproxy") == "toolproxy"  # minimal values: an ACL user
    assert "toolproxy-record-mac" not in mounts(opa).values()
    assert not {"toolproxy-record-mac", "toolproxy-opa-token"} & set(mounts(agent).values())
    mac_volume = next(v for v in pod["volumes"] if v["name"] == "toolproxy-record-mac")
    assert mac_volume["secret"]["secretName"] == "toolproxy-record-mac"  # the fleet's, never generated
    secret = one(rendered, "Secret", "-secrets")
    assert set(secret["data"]) == {"opa-token"}
    token_ref = next(e for e in opa["env"] if e["name"] == "TOOLPROXY_OPA_TOKEN")["valueFrom"]["secretKeyRef"]
    assert token_ref == {"name": secret["metadata"]["name"], "key": "opa-token"}
    assert "--authentication=token" in opa["args"] and "--authorization=basic" in opa["args"]


@pytest.mark.parametrize("set_values, message", [
    ({}, "proxy.redis: no credentials"),
    ({"proxy.redis.username": "toolproxy", "proxy.redis.allowUnauthenticated": "true"},
     "needs proxy.redis.passwordSecret"),
])
def test_a_redis_without_credentials_fails_the_render(set_values, message):
    with pytest.raises(HelmError, match=re.escape(message)):
        render([], set_values=set_values, set_json=FLEET_KEYS)
    # The escape hatch, named to be noticed.
    if not set_values:
        assert render([], set_values={"proxy.redis.allowUnauthenticated": "true"}, set_json=FLEET_KEYS)


def test_registry_change_rolls_the_pods_but_a_policy_change_does_not():
    base = agent_pod(render())["metadata"]["annotations"]
    other_registry = agent_pod(render([PRODUCTION_VALUES]))["metadata"]["annotations"]
    other_policy = agent_pod(render(set_json={"opa.policies.files": {"x.rego": "package x\n"}}))
    assert base["checksum/toolproxy-registry"] != other_registry["checksum/toolproxy-registry"]
    assert other_policy["metadata"]["annotations"] == base


# ---------------------------------------------------------------------------
# Who can reach what: listeners, Services, NetworkPolicy
# ---------------------------------------------------------------------------

def test_agent_api_is_loopback_only_and_admin_is_a_separate_service(rendered):
    pod = agent_pod(rendered)["spec"]
    config = yaml.safe_load(configmap_of(rendered, pod, "toolproxy-config")["data"]["config.yaml"])
    assert config["listen"]["host"] == "127.0.0.1"
    assert config["admin"]["port"] != config["listen"]["port"]
    exposed = {p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])}
    assert config["listen"]["port"] not in exposed
    for service in find(rendered, "Service"):
        for port in service["spec"]["ports"]:
            assert port["port"] != config["listen"]["port"], service["metadata"]["name"]
    admin = one(rendered, "Service", "-admin")
    assert [p["targetPort"] for p in admin["spec"]["ports"]] == ["tp-admin"]
    labels = agent_pod(rendered)["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in admin["spec"]["selector"].items())


def egress_ports(policy):
    return [(r.get("to"), {(p["port"], p.get("protocol", "TCP")) for p in r["ports"]}) for r in policy["spec"]["egress"]]


def test_networkpolicy_limits_egress_to_dns_redis_and_declared_backends(rendered):
    policy = one(rendered, "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    labels = agent_pod(rendered)["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in policy["spec"]["podSelector"]["matchLabels"].items())
    rules = egress_ports(policy)
    for to, ports in rules:
        assert to, "an egress rule without `to` would allow every destination"
        assert ports, "an egress rule without ports would allow every port"
    all_ports = set().union(*(ports for _, ports in rules))
    assert {(53, "UDP"), (53, "TCP")} <= all_ports
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), "an ingress rule without `from` would admit everyone"


def test_demo_networkpolicy_has_the_tool_backend_and_redis_rules(demo):
    rules = egress_ports(one(demo, "NetworkPolicy"))
    by_ports = {frozenset(ports): to for to, ports in rules}
    assert by_ports[frozenset({(8080, "TCP")})][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "shop"}
    assert by_ports[frozenset({(6380, "TCP")})][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "redis"}
    assert frozenset({(443, "TCP")}) in by_ports  # the agent's LLM gateway (extraEgress)
    ingress = one(demo, "NetworkPolicy")["spec"]["ingress"]
    admin = [r for r in ingress if {p["port"] for p in r["ports"]} == {8788}]
    assert len(admin) == 1 and admin[0]["from"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "approver-ui"}


def test_empty_admin_peers_leave_the_admin_port_closed():
    policy = one(render(set_json={"networkPolicy.adminFrom": []}), "NetworkPolicy")
    assert all(8788 not in {p["port"] for p in r["ports"]} for r in policy["spec"]["ingress"])


def test_bundle_mode_pulls_policies_and_opens_egress_to_the_bundle_server():
    manifests = render(set_values={"opa.policySource": "bundle", "opa.bundle.serviceUrl": "https://bundles.example.com",
                                   "opa.bundle.tokenSecret.name": "bundle-token"},
                       set_json={"networkPolicy.opaBundle.to": [{"ipBlock": {"cidr": "10.9.0.0/16"}}]})
    pod = agent_pod(manifests)["spec"]
    opa = containers(pod)["toolproxy-opa"]
    assert not find(manifests, "ConfigMap", "-policies")
    config_arg = next(a for a in opa["args"] if a.startswith("--config-file="))
    config_dir = str(Path(config_arg.split("=", 1)[1]).parent)
    assert mounts(opa)[config_dir] == "toolproxy-opa-config"
    opa_config = yaml.safe_load(one(manifests, "ConfigMap", "-opa-config")["data"]["config.yaml"])
    assert opa_config["services"]["bundle-server"]["url"] == "https://bundles.example.com"
    token_path = opa_config["services"]["bundle-server"]["credentials"]["bearer"]["token_path"]
    assert mounts(opa)[str(Path(token_path).parent)] == "toolproxy-opa-bundle-token"
    assert opa["readinessProbe"]["httpGet"]["path"] == opa["startupProbe"]["httpGet"]["path"] == "/health?bundles"
    assert [c["name"] for c in pod["initContainers"]] == ["toolproxy-opa", "toolproxy"], "the bundle ships the catalog"
    loaded = [a for a in opa["args"] if not a.startswith("-") and a != "run"]
    assert loaded == [next(p for p, v in mounts(opa).items() if v == "toolproxy-opa-authz")], loaded
    ports = set().union(*(p for _, p in egress_ports(one(manifests, "NetworkPolicy"))))
    assert (443, "TCP") in ports


# ---------------------------------------------------------------------------
# values.schema.json refuses bad values
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--set", "proxy.ports.admin=abc"], "/proxy/ports/admin"),
    (["--set", "proxy.ports.ops=70000"], "/proxy/ports/ops"),
    (["--set-string", "opa.port=8181"], "/opa/port"),
    (["--set", "proxy.securityContext.runAsNonRoot=false"], "/proxy/securityContext/runAsNonRoot"),
    (["--set", "opa.securityContext.readOnlyRootFilesystem=false"], "/opa/securityContext/readOnlyRootFilesystem"),
    (["--set", "proxy.tiemouts=1"], "tiemouts"),
    (["--set", "opa.policySource=git"], "/opa/policySource"),
    (["--set", "proxy.redis.url=http://redis:6379"], "/proxy/redis/url"),
    (["--set-json", "networkPolicy.redis.to=[]"], "/networkPolicy/redis/to"),
    (["--set-json", 'networkPolicy.toolBackends=[{"name":"x","to":[{"podSelector":{}}],"ports":[{"port":"http"}]}]'],
     "/networkPolicy/toolBackends/0/ports/0/port"),
], ids=["string-port", "port-range", "quoted-port", "root", "rw-rootfs", "typo", "enum", "redis-scheme",
        "redis-everyone", "backend-port"])
def test_schema_refuses_bad_values_in_template_and_lint(args, message):
    for command in (["template", "t", str(CHART)], ["lint", str(CHART)]):
        with pytest.raises(HelmError) as info:
            helm(*command, *args)
        assert message in str(info.value), str(info.value)


GUARDED = {"egressGuard.enabled": "true", "podSecurityLevel": "privileged"}  # the guard needs NET_ADMIN


@pytest.mark.parametrize("set_values, message", [
    ({"proxy.ports.admin": 8282}, "must all differ"),
    ({"opa.allowTcp": "true", "proxy.ports.ops": 8181}, "must all differ"),
    ({"egressGuard.enabled": "true"}, "/podSecurityLevel"),
    ({"agent.securityContext.allowPrivilegeEscalation": "true"}, "/agent/securityContext/allowPrivilegeEscalation"),
    ({"proxy.integrity.macKeySecret.name": ""}, "proxy.integrity.macKeySecret.name: no record MAC key"),
    ({"proxy.callTokens.secretName": ""}, "proxy.callTokens.secretName: no call-token signing key"),
    ({"proxy.callTokens.keyId": "other"}, 'no key with kid "other"'),
    ({"opa.policySource": "bundle", "networkPolicy.enabled": "false"}, "/opa/bundle/serviceUrl"),
    ({"opa.policySource": "bundle", "opa.bundle.serviceUrl": "https://b"}, "/networkPolicy/opaBundle/to"),
    ({"opa.policySource": "bundle", "opa.bundle.serviceUrl": "https://b", "networkPolicy.enabled": "false",
      "opa.catalog.existingConfigMap": "my-catalog"}, "the bundle carries"),
    ({"registry.includeExamples": "false"}, "no tool registry"),
    ({"proxy.redis.tls.secretName": "tls"}, "not rediss://"),
    ({"opa.catalog.generate": "false"}, "no tool catalog for OPA"),
    # The agent's UID inherited from the pod, or left to its image: the egress guard would let the agent through.
    ({**GUARDED, "agent.securityContext.runAsUser": "null", "podSecurityContext.runAsUser": 10001},
     "the agent's UID (agent.securityContext.runAsUser, else podSecurityContext.runAsUser) must differ"),
    ({**GUARDED, "agent.securityContext.runAsUser": "null"}, "egressGuard.enabled needs the agent's UID"),
])
def test_template_or_schema_refuses_inconsistent_values(set_values, message):
    with pytest.raises(HelmError, match=re.escape(message)):
        render(set_values=set_values)


# ---------------------------------------------------------------------------
# The named templates, included by a team's own chart
# ---------------------------------------------------------------------------

TEAM_DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ .Release.Name }}-team-agent
spec:
  selector:
    matchLabels: {app: team-agent}
  template:
    metadata:
      labels:
        app: team-agent
        {{- include "toolproxy.podLabels" .Subcharts.toolproxy | nindent 8 }}
      annotations:
        {{- include "toolproxy.podAnnotations" .Subcharts.toolproxy | nindent 8 }}
    spec:
      serviceAccountName: team-agent
      automountServiceAccountToken: false
      shareProcessNamespace: false
      initContainers:
        {{- include "toolproxy.initContainers" .Subcharts.toolproxy | nindent 8 }}
      containers:
        - name: agent
          image: team/agent:1
          env:
            {{- include "toolproxy.agentEnv" .Subcharts.toolproxy | nindent 12 }}
        {{- /* Renders nothing now (the sidecars are init containers): a chart written before still renders. */}}
        {{- include "toolproxy.sidecars" .Subcharts.toolproxy | nindent 8 }}
      volumes:
        - {name: scratch, emptyDir: {}}
        {{- include "toolproxy.volumes" .Subcharts.toolproxy | nindent 8 }}
"""


def test_team_chart_includes_the_sidecars_through_the_named_templates(tmp_path):
    team = tmp_path / "team-agent"
    (team / "templates").mkdir(parents=True)
    chart_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    (team / "Chart.yaml").write_text("apiVersion: v2\nname: team-agent\nversion: 1.0.0\ndependencies:\n"
                                     f"  - name: toolproxy\n    version: {chart_version}\n")
    (team / "values.yaml").write_text(yaml.safe_dump({"toolproxy": {
        "agent": {"enabled": False},
        "proxy": {"ports": {"agent": 9000}, "redis": {"passwordSecret": {"name": "team-redis", "key": "password"}},
                  "integrity": {"macKeySecret": {"name": "team-record-mac", "key": "mac.key"}},
                  "callTokens": {"secretName": "team-call-tokens", "jwks": {"keys": [PUBLIC_JWK]}}}}}))
    (team / "templates" / "deployment.yaml").write_text(TEAM_DEPLOYMENT)
    shutil.copytree(CHART, team / "charts" / "toolproxy", symlinks=False)  # as `helm dependency build` unpacks it
    manifests = render(chart=team, release="shop")
    assert not find(manifests, "Deployment", "-toolproxy-agent"), "the example agent is off"
    deployment = one(manifests, "Deployment", "-team-agent")
    pod = deployment["spec"]["template"]
    assert list(containers(pod["spec"])) == RUNNING
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["toolproxy-opa-catalog", "toolproxy-opa", "toolproxy"]
    assert containers(pod["spec"])["agent"]["env"] == [{"name": "TOOLPROXY_URL", "value": "http://127.0.0.1:9000"}]
    config = yaml.safe_load(configmap_of(manifests, pod["spec"], "toolproxy-config")["data"]["config.yaml"])
    assert config["listen"]["port"] == 9000
    # Every ConfigMap the volumes name is rendered by the subchart.
    rendered_maps = {m["metadata"]["name"] for m in find(manifests, "ConfigMap")}
    for volume in pod["spec"]["volumes"]:
        if "configMap" in volume:
            assert volume["configMap"]["name"] in rendered_maps
    # The subchart's Services and NetworkPolicy select the team's pods.
    labels = pod["metadata"]["labels"]
    for selector in ([one(manifests, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"]]
                     + [s["spec"]["selector"] for s in find(manifests, "Service")]):
        assert all(labels.get(k) == v for k, v in selector.items()), selector
    assert "checksum/toolproxy-registry" in pod["metadata"]["annotations"]


# ---------------------------------------------------------------------------
# Monitoring objects
# ---------------------------------------------------------------------------

def test_servicemonitor_scrapes_the_metrics_service_ports(demo):
    monitor = one(demo, "ServiceMonitor")
    service = one(demo, "Service", "-metrics")
    assert all(service["metadata"]["labels"].get(k) == v
               for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= service_ports
    assert {e["path"] for e in monitor["spec"]["endpoints"]} == {"/metrics"}


def test_monitoring_objects_are_off_by_default(default):
    assert not find(default, "ServiceMonitor") and not find(default, "PrometheusRule")


def test_prometheusrule_carries_the_rules_file(demo):
    rule = one(demo, "PrometheusRule")
    source = yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    assert rule["spec"]["groups"] == source["groups"]
    assert rule["metadata"]["labels"]["release"] == "prometheus"


# ---------------------------------------------------------------------------
# Dockerfile (no Docker engine here: checked statically; its entrypoint is run
# for real by test_helm_pod.py)
# ---------------------------------------------------------------------------

def test_dockerfile_is_multi_stage_with_a_slim_non_root_final_stage():
    stages = dockerfile_stages()
    assert len(stages) >= 2
    args = {m.group(1): m.group(2) for m in re.finditer(r"^ARG (\w+)=(\S+)$", (REPO / "Dockerfile").read_text(), re.M)}
    final = stages[-1]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], final[0][1].split()[0])
    assert re.search(r"-slim|distroless", base), base
    users = [rest for ins, rest in final if ins == "USER"]
    assert users and re.fullmatch(r"[1-9][0-9]*(:[1-9][0-9]*)?", users[-1]), users
    for instruction, rest in final:
        if instruction == "RUN":
            # The only RUN removes pip and adds Debian's nftables (the egress guard's nft); nothing else is
            # installed or compiled in the final stage.
            assert re.fullmatch(r"python -m pip uninstall [-\w ]+ && apt-get update -qq && apt-get install -y -qq "
                                r"--no-install-recommends nftables && rm -rf /var/lib/apt/lists/\*",
                                " ".join(rest.split())), rest
    copies = [rest for ins, rest in final if ins == "COPY"]
    assert copies and all(rest.startswith("--from=") for rest in copies), "final stage copies only build output"
    for ins, rest in stages[0]:
        if ins == "COPY":
            for source in rest.split()[:-1]:
                assert (REPO / source).exists(), source
    assert entrypoint()[:3] == ["python", "-m", "proxy.cli"]


def test_dockerfile_installs_exactly_the_runtime_dependencies():
    text = (REPO / "Dockerfile").read_text()
    assert "['project']['dependencies']" in text and "--only-binary=:all:" in text
    ignore = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*" and {"!proxy/", "!schemas/", "!pyproject.toml"} <= set(ignore)



def test_the_call_token_key_is_mounted_into_the_proxy_alone_and_its_public_keys_render_for_backends():
    public = PUBLIC_JWK
    manifests = render(set_values={"proxy.callTokens.secretName": "toolproxy-call-tokens",
                                   "proxy.callTokens.keyId": "2026-02",
                                   "proxy.callTokens.verificationKeysKey": "previous.json"},
                       set_json={"proxy.callTokens.jwks": {"keys": [public]}})
    pod = agent_pod(manifests)["spec"]
    proxy = containers(pod)["toolproxy"]
    config = yaml.safe_load(configmap_of(manifests, pod, "toolproxy-config")["data"]["config.yaml"])
    key_file = Path(config["call_tokens"]["signing_key_file"])
    assert config["call_tokens"]["key_id"] == "2026-02"
    assert Path(config["call_tokens"]["verification_keys_file"]).parent == key_file.parent
    assert mounts(proxy)[str(key_file.parent)] == "toolproxy-call-tokens"
    volume = next(v for v in pod["volumes"] if v["name"] == "toolproxy-call-tokens")
    assert volume["secret"]["secretName"] == "toolproxy-call-tokens"
    assert [i["path"] for i in volume["secret"]["items"]] == [key_file.name, "previous.json"]
    for name, container in containers(pod).items():
        if name != "toolproxy":
            assert "toolproxy-call-tokens" not in {m["name"] for m in container.get("volumeMounts", [])}, name
    for init in pod.get("initContainers", []):
        if init["name"] != "toolproxy":
            assert "toolproxy-call-tokens" not in {m["name"] for m in init.get("volumeMounts", [])}, init["name"]
    assert json.loads(one(manifests, "ConfigMap", "-call-token-jwks")["data"]["jwks.json"]) == {"keys": [public]}
    # A private member never renders; no public key, no render (backends would have nothing to trust).
    with pytest.raises(HelmError, match="/proxy/callTokens/jwks"):
        render(set_json={"proxy.callTokens.jwks": {"keys": [{**public, "d": "private"}]}})
    with pytest.raises(HelmError, match="proxy.callTokens.jwks: no public keys"):
        render(set_json={"proxy.callTokens.jwks": {"keys": []}})


def test_backend_credentials_are_mounted_into_the_proxy_only_and_named_in_its_config(tmp_path):
    """Each credential's Secret in the toolproxy container only; its _file settings name keys of that Secret."""
    credentials = {"stripe-key": {"secretName": "stripe-api-key", "settings": {"kind": "bearer", "secret_file": "key"}},
                   "crm-as-user": {"secretName": "toolproxy-oidc", "settings": {
                       "kind": "client_credentials", "token_url": "https://sso.example.com/token",
                       "client_id": "toolproxy", "client_secret_file": "client-secret", "scope": "crm.read"}}}
    manifests = render(set_json={"proxy.credentials": credentials})
    pod = agent_pod(manifests)["spec"]
    proxy, opa, agent = containers(pod)["toolproxy"], containers(pod)["toolproxy-opa"], containers(pod)["agent"]
    config = yaml.safe_load(configmap_of(manifests, pod, "toolproxy-config")["data"]["config.yaml"])
    secrets = {"stripe-api-key": {"key": "sk-live"}, "toolproxy-oidc": {"client-secret": "cs"}, **DEMO_SECRETS}
    local = LocalPod(manifests, pod, tmp_path, secrets=secrets)
    for name, credential in credentials.items():
        volume = f"toolproxy-cred-{name}"
        assert volume in mounts(proxy).values() and volume not in mounts(opa).values()
        assert volume not in mounts(agent).values()
        assert next(v for v in pod["volumes"] if v["name"] == volume)["secret"]["secretName"] == credential["secretName"]
        rendered = config["credentials"][name]
        file_setting = next(k for k in rendered if k.endswith("_file"))
        path = Path(rendered[file_setting])
        assert mounts(proxy)[str(path.parent)] == volume
        assert path.name in local.volume_files(volume)  # the key the setting names is in the mounted Secret
    assert config["credentials"]["crm-as-user"]["scope"] == "crm.read"
    config_file = local.volume_dir("toolproxy-config") / "config.yaml"
    assert load_config(config_file, env=local.env("toolproxy")).credentials["stripe-key"].kind == "bearer"
    with pytest.raises(HelmError, match="credentials"):
        render(set_json={"proxy.credentials": {"Stripe_Key": credentials["stripe-key"]}})
