"""Errors that name the fix: a newcomer's misconfiguration, and the one line it gets.

Each test makes one mistake a newcomer made (a misspelled backend service, ...) against real parts and
asserts the line that names the setting, the value and the fix, with no traceback.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from tests.support.proxyproc import fleet_key_env
from tests.support.stack import DEMO_REGISTRY, running_stack

REPO = Path(__file__).resolve().parent.parent


def misspelled_service_registry(directory: Path) -> Path:
    """The demo registry with get_order's backend service misspelled ``demoo``."""
    directory.mkdir(exist_ok=True)
    text = (DEMO_REGISTRY / "demo-tools.yaml").read_text()
    wrong = text.replace("service: demo, path: /tools/get_order}", "service: demoo, path: /tools/get_order}", 1)
    assert wrong != text
    (directory / "demo-tools.yaml").write_text(wrong)
    return directory


def run_proxy(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", "run"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "TOOLPROXY_IDENTITY_MODE": "static",
                                           **fleet_key_env(), **env})


# -- a misspelled backend service: refused at load and at reload, naming the service ------------------------

def test_a_misspelled_backend_service_stops_toolproxy_run_with_one_line(tmp_path):
    registry = misspelled_service_registry(tmp_path / "registry")
    result = run_proxy({"TOOLPROXY_REGISTRY_PATHS": str(registry),
                        "TOOLPROXY_BACKENDS_SERVICES": "demo=http://127.0.0.1:9"})
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    line = result.stderr
    assert "tool get_order 1.0.0: backend service demoo is not in backends.services" in line
    assert "did you mean demo?" in line and "demo-tools.yaml" in line


async def test_a_misspelled_backend_service_is_refused_at_reload(proxy_deps, tmp_path, caplog):
    registry = tmp_path / "registry"
    registry.mkdir()
    (registry / "demo-tools.yaml").write_text((DEMO_REGISTRY / "demo-tools.yaml").read_text())
    async with running_stack({**proxy_deps, "registry.paths": [str(registry)], "reconcile.enabled": False,
                              "registry.reload_interval_ms": 0}) as stack:
        misspelled_service_registry(registry)
        with caplog.at_level(logging.INFO, logger="toolproxy.registry"):
            assert await stack.runtime.reloader.reload() == "refused"
        [refused] = [r.getMessage() for r in caplog.records if r.name == "toolproxy.registry"]
        assert "registry reload refused" in refused and "backend service demoo" in refused
        _, env = await stack.call("get_order", {"order_id": "ord_1001"})
        assert env["outcome"] == "succeeded", "the running registry stays"


# -- check-registry: a required name that is not a property, with unknown properties refused ----------------

def check_registry(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", "check-registry", "--dev", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_check_registry_refuses_a_required_name_that_is_not_a_property(tmp_path):
    registry = tmp_path / "notes.yaml"
    registry.write_text("""tools:
  - name: make_note
    version: "1.0.0"
    description: Make a note.
    mode: read
    risk: read
    inputSchema:
      type: object
      additionalProperties: false
      required: [text, titel]
      properties:
        text: {type: string}
        title: {type: string}
    backend: {type: http, url: "http://127.0.0.1:9/notes"}
""")
    result = check_registry(registry)
    assert result.returncode == 1 and result.stderr.count("\n") <= 1 and "Traceback" not in result.stderr
    assert ("at $.tools[0].inputSchema.required: titel (did you mean title?) is required but not in properties, "
            "and additionalProperties is false: no call can satisfy it") in result.stderr + result.stdout


def test_check_registry_does_not_tell_a_new_write_that_a_default_changed(tmp_path):
    registry = tmp_path / "vouchers.yaml"
    registry.write_text((REPO / "docs" / "getting-started.md").read_text().split(
        "<!-- guide: file my-tools/vouchers.yaml -->\n```yaml\n")[1].split("```")[0])
    result = check_registry(registry)
    assert result.returncode == 0, result.stderr
    assert "changed" not in result.stdout + result.stderr
    assert "requires a key a retry reproduces" in result.stdout + result.stderr


# -- policy check on real schemas: $ref into $defs, a nullable amount, a package the decision never reads,
#    and the policy data's own schema ------------------------------------------------------------------------

REF_AND_NULLABLE_TOOLS = """tools:
  - name: set_status
    version: "1.0.0"
    description: Set a ticket's status.
    mode: read
    risk: read
    inputSchema:
      type: object
      additionalProperties: false
      required: [ticket, status]
      properties:
        ticket: {type: string}
        status: {$ref: "#/$defs/Status"}
        note: {anyOf: [{type: string}, {type: "null"}], default: null}
      $defs:
        Status: {enum: [open, closed], title: Status, type: string}
    backend: {type: http, url: "http://127.0.0.1:9/s"}
  - name: pay_tip
    version: "1.0.0"
    description: Pay a tip.
    mode: read
    risk: read
    inputSchema:
      type: object
      additionalProperties: false
      required: [amount]
      properties:
        amount: {anyOf: [{type: number}, {type: "null"}]}
    backend: {type: http, url: "http://127.0.0.1:9/t"}
"""


def test_policy_check_on_ref_schemas_nullable_amounts_unreached_packages_and_the_data_schema(tmp_path):
    import json
    import shutil

    policies, data = tmp_path / "policies", tmp_path / "data"
    shutil.copytree(REPO / "policies", policies)
    shutil.copytree(REPO / "examples" / "opa", data)
    document = json.loads((data / "data.json").read_text())
    document["toolproxy"]["settings"]["approval"]["thresholds"]["pay_tip"] = {"argument": "amount", "default": 500}
    del document["toolproxy"]["meta"]
    (data / "data.json").write_text(json.dumps(document))
    (tmp_path / "tools.yaml").write_text(REF_AND_NULLABLE_TOOLS)
    (policies / "tickets.rego").write_text('package toolproxy.tools\n\ndeny contains "closing_tickets" if {\n'
                                           '\tinput.action == "call"\n\tinput.tool.name == "set_status"\n'
                                           '\tinput.arguments.status == "closed"\n}\n')
    (policies / "lonely.rego").write_text('package toolproxy.vouchers\n\ndeny contains "blocked" if {\n'
                                          '\tinput.action == "call"\n\tinput.tool.name == "pay_tip"\n}\n')
    done = subprocess.run([sys.executable, "-m", "proxy.cli", "policy", "check", "--policy", str(policies),
                           "--data", str(data), "--registry", str(REPO / "examples" / "registry"),
                           str(tmp_path / "tools.yaml"), "--format", "json"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 1, done.stderr
    problems = json.loads(done.stdout)["problems"]
    assert {(p["kind"], Path(p["file"]).name, p["path"]) for p in problems} == {
        ("package_never_reached", "lonely.rego", "line 1"),
        ("policy_data_schema", "data.json", "toolproxy.meta"),
    }, problems  # no opa_type_check for the $ref argument, no argument_not_in_schema for the nullable amount
    [lonely] = [p["message"] for p in problems if p["kind"] == "package_never_reached"]
    assert lonely.startswith("package toolproxy.vouchers is never read by the decision (data.toolproxy.decision)")
    assert "toolproxy.tools" in lonely and "docs/policy-authors.md#your-first-rule" in lonely


# -- policy replay --redis against a Redis that wants a password ------------------------------------------

def test_policy_replay_against_a_password_redis_is_one_line_and_honours_the_variable(tmp_path):
    import os

    from tests.support.servers import RedisServer

    server = RedisServer(data_dir=tmp_path / "redis", password="dev-stack-secret")
    server.start()
    try:
        argv = [sys.executable, "-m", "proxy.cli", "policy", "replay", "--redis", server.url]
        bare = {k: v for k, v in os.environ.items() if not k.startswith("TOOLPROXY_REDIS_")}
        refused = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO, env=bare)
        assert refused.returncode == 2
        assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert refused.stderr.startswith(f"toolproxy policy replay: Redis at {server.url} refused the read")
        assert "set TOOLPROXY_REDIS_PASSWORD" in refused.stderr and "dev-stack-secret" not in refused.stderr
        read = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO,
                              env={**bare, "TOOLPROXY_REDIS_PASSWORD": "dev-stack-secret"})
        assert read.returncode == 0, read.stderr
        assert read.stdout.startswith("records: 0"), read.stdout
    finally:
        server.stop()


# -- toolproxy run with Redis and OPA unreachable; a port that is taken --------------------------------------

def test_run_with_redis_and_opa_away_names_each_once_and_does_not_storm(tmp_path):
    import os
    import signal
    import socket
    import time

    from tests.support.servers import free_port

    # A port that accepts and at once closes every connection: Redis never answers there, and the count of
    # connections says how many retries the proxy made (the observation window ends on it, not on a clock).
    refuser = socket.socket()
    refuser.bind(("127.0.0.1", 0))
    refuser.listen(64)
    refuser.settimeout(0.2)
    dead = refuser.getsockname()[1]
    env = {"PATH": "/usr/bin:/bin", "TOOLPROXY_IDENTITY_MODE": "static", **fleet_key_env(),
           "TOOLPROXY_REGISTRY_PATHS": str(DEMO_REGISTRY), "TOOLPROXY_BACKENDS_SERVICES": "demo=http://127.0.0.1:9",
           "TOOLPROXY_REDIS_URL": f"redis://:hunter2@127.0.0.1:{dead}/0",
           "TOOLPROXY_OPA_URL": f"unix://{tmp_path}/no-opa.sock",
           "TOOLPROXY_LISTEN_PORT": str(free_port()), "TOOLPROXY_ADMIN_PORT": str(free_port()),
           "TOOLPROXY_OPS_PORT": str(free_port())}
    log = tmp_path / "run.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", "run"], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "toolproxy listening" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        # Several retry periods of every listener (backoff from 0.1 s): wait until Redis was tried 12 times
        # after start-up, bounded.
        attempts, deadline = 0, time.monotonic() + 60
        while attempts < 12:
            assert proc.poll() is None and time.monotonic() < deadline, (attempts, log.read_text()[-3000:])
            try:
                conn, _ = refuser.accept()
            except socket.timeout:
                continue
            conn.close()
            attempts += 1
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        refuser.close()
    text = log.read_text()
    assert "hunter2" not in text
    assert text.count(f"redis://127.0.0.1:{dead}/0 (redis.url) does not answer at start-up") == 1, text
    assert text.count(f"OPA at unix://{tmp_path}/no-opa.sock (opa.url)") == 1, text
    for listener in ("back-pressure channel lost", "cancellation channel lost"):
        assert text.count(listener) <= 1, text  # once per loss, not once per retry
    assert "Traceback" not in text


def test_dev_and_run_name_a_taken_port_in_one_line(tmp_path):
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        dev = subprocess.run([sys.executable, "-m", "proxy.cli", "dev", "--proxy-port", str(port)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert dev.returncode == 1 and dev.stderr.count("\n") == 1 and "Traceback" not in dev.stderr, dev.stderr
        assert dev.stderr.startswith(f"toolproxy dev: --proxy-port {port} already in use")
        run = subprocess.run([sys.executable, "-m", "proxy.cli", "run"], cwd=REPO, capture_output=True, text=True,
                             timeout=60, env={"PATH": "/usr/bin:/bin", "TOOLPROXY_IDENTITY_MODE": "static",
                                              **fleet_key_env(), "TOOLPROXY_REGISTRY_PATHS": str(DEMO_REGISTRY),
                                              "TOOLPROXY_LISTEN_PORT": str(port)})
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        [line] = [line for line in run.stderr.splitlines() if line.startswith("toolproxy:")]
        assert "cannot listen" in line and f"listen.port {port}" in line
    finally:
        holder.close()


# -- forbidden: the developer gets where to look, never the policy's reasons ---------------------------------

async def test_forbidden_points_the_developer_at_the_explanation_without_the_reasons(proxy_deps):
    async with running_stack({**proxy_deps, "decisions.enabled": True, "reconcile.enabled": False}) as stack:
        status, env = await stack.call("refund_order", {"order_id": "ord_2001", "amount": 100, "reason": "x"},
                                       headers={"Idempotency-Key": "forbidden-1"})
    assert env["error"]["code"] == "forbidden", env
    details = env["error"]["details"]
    found_by = details.get("decision_id") or env["request_id"]
    assert details["explain"] == f"toolproxy policy explain --decision-id {found_by} --redis <the proxy's redis.url>"
    assert details["console"].startswith("/ui#denials")
    assert "resource_not_owned" not in str(env)  # the reason stays with operators
    # The command it names explains this very decision, from the recorded ones.
    command = details["explain"].replace("<the proxy's redis.url>", proxy_deps["redis.url"]).split()
    done = subprocess.run([sys.executable, "-m", "proxy.cli", *command[1:]], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "reason resource_not_owned:order:ord_2001" in done.stdout, done.stdout


# -- one key form everywhere, and the two keys named apart --------------------------------------------------

async def test_an_operation_is_read_by_the_callers_own_key_as_cancel_takes_it(proxy_deps):
    async with running_stack({**proxy_deps, "reconcile.enabled": False}) as stack:
        _, env = await stack.call("refund_order", {"order_id": "ord_1001", "amount": 100, "reason": "dup"},
                                  headers={"Idempotency-Key": "my-refund-1"})
        assert env["outcome"] == "succeeded", env
        assert env["operation_key"].startswith("ik_") and env["idempotency_key"] == env["operation_key"]
        async with stack.session.get(stack.proxy_url + "/v1/operations/my-refund-1?tool=refund_order") as response:
            by_own_key = await response.json()
        async with stack.session.get(stack.proxy_url + f"/v1/operations/{env['operation_key']}") as response:
            by_operation_key = await response.json()
    assert by_own_key["operation_key"] == env["operation_key"] == by_operation_key["operation_key"]
    assert by_own_key["state"] == "SUCCEEDED"


# -- an OpenAI-shaped tool listing a runner passes to the model as it is ---------------------------------------

async def test_the_openai_tool_listing_is_the_callers_tools_in_openais_shape(proxy_deps):
    async with running_stack({**proxy_deps, "reconcile.enabled": False}) as stack:
        async with stack.session.get(stack.proxy_url + "/v1/openai/tools") as response:
            assert response.status == 200
            listed = (await response.json())["tools"]
        async with stack.session.get(stack.proxy_url + "/v1/tools") as response:
            plain = (await response.json())["tools"]
        names = [t["function"]["name"] for t in listed]
        assert len(names) == len(set(names)) and set(names) == {t["name"] for t in plain}
        assert all(set(t) == {"type", "function"} and t["type"] == "function" for t in listed)
        [get_order] = [t["function"] for t in listed if t["function"]["name"] == "get_order"]
        [contract] = [t for t in plain if t["name"] == "get_order"]
        assert get_order == {"name": "get_order", "description": contract["description"],
                             "parameters": contract["inputSchema"]}
        # What the model calls from that listing runs.
        status, turn = await stack.post("/v1/openai/tool-calls", {"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_order", "arguments": '{"order_id": "ord_1001"}'}}]})
        assert status == 200 and turn["batch"]["status"] == "succeeded", turn


# -- YAML errors name the file, in one line --------------------------------------------------------------------

def test_a_yaml_error_names_the_file_in_one_line(tmp_path):
    bad = tmp_path / "tools.yaml"
    bad.write_text("tools:\n  - name: x\n    mode: [read\n")
    result = check_registry(bad)
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "<unicode string>" not in result.stderr
    assert f'in "{bad}", line 3, column 11' in result.stderr, result.stderr
    config = tmp_path / "config.yaml"
    config.write_text("identity:\n  mode: [x\n")
    run = subprocess.run([sys.executable, "-m", "proxy.cli", "run", "-c", str(config)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and f'in "{config}", line 2' in run.stderr


# -- resource ownership at scale: the documented rule for ids that carry their tenant ------------------------

def test_the_documented_ownership_rule_for_ids_that_name_their_tenant(tmp_path):
    import json
    import re
    import shutil

    text = (REPO / "docs" / "authorization.md").read_text()
    section = text.split("## Resource ownership at scale", 1)[1]
    rule = re.search(r"```rego\n(.*?)```", section, flags=re.S)[1]
    policies = tmp_path / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "ownership_in_ids.rego").write_text(rule)

    def explain(order_id: str) -> dict:
        body = {"tool": "get_order", "arguments": {"order_id": order_id}}
        done = subprocess.run([sys.executable, "-m", "proxy.cli", "policy", "explain", "--body", "-",
                               "--policy", str(policies), "--tenant", "acme", "--roles", "agent",
                               "--format", "json"], input=json.dumps(body), capture_output=True, text=True,
                              timeout=120, cwd=REPO)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["decision"]

    assert explain("ord_acme7")["allow"] is True
    refused = explain("ord_globex7")
    assert refused["allow"] is False and "resource_not_owned:order:ord_globex7" in refused["reasons"]
    assert explain("ord_1001")["allow"] is True  # ids listed in data still work beside the rule
