"""Contract versions over time (issue 15, part three; seed 004 §27-29).

Deprecated/retired statuses, the run pin in Redis, registry reload without a
restart (in process and as a real ``toolproxy run`` process with SIGHUP and
file polling), the catalog pushed again to a real OPA, ``registry diff`` /
``check-registry --previous``, and replay of recorded operations across a
version switch. Real OPA, Redis and demo backend throughout.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from examples.demo_backend import start_demo_backend
from tests.support.calltokens import session_keys
from tests.support.metrics import samples, scrape_text
from tests.support.proxyproc import ProxyProcess
from tests.support.stack import DEMO_REGISTRY, assert_envelope, running_stack
from tests.support.waits import wait_until
from tests.test_mcp_front import CLIENT_META, modern_headers, post as mcp_post, rpc
from tests.unit.test_contract_lifecycle import DEPRECATED_V1, contract, write_tools


@pytest.fixture
def registry_dir(tmp_path):
    """The demo registry (every tool at 1.0.0) in a directory a test may edit."""
    directory = tmp_path / "registry"
    directory.mkdir()
    (directory / "demo-tools.yaml").write_text((DEMO_REGISTRY / "demo-tools.yaml").read_text())
    return directory


def versions_v2(directory: Path, *, v1: dict[str, Any] | None = None) -> None:
    """adjust_counter, refund_order and get_order gain 2.0.0 (the new default); 1.0.0 becomes ``v1``."""
    tools = yaml.safe_load((DEMO_REGISTRY / "demo-tools.yaml").read_text())["tools"]
    for tool in tools:
        if tool["name"] in ("adjust_counter", "refund_order", "get_order") and v1:
            tool.update(v1)
    write_tools(directory / "demo-tools.yaml", tools)
    v2 = [contract(n, "2.0.0", description=f"{n}, contract 2") for n in ("adjust_counter", "refund_order", "get_order")]
    for tool in v2:  # the refund's related read moves to the read's new version with it (v1 may be retired)
        if tool.get("related_read"):
            tool["related_read"] = {**tool["related_read"], "version": "2.0.0"}
    write_tools(directory / "v2.yaml", v2)


# -- registry: statuses, dates, successors --------------------------------------------------------


# -- registry diff and the CI gate ---------------------------------------------------------------


# -- calls to deprecated versions: headers, envelope, metric, MCP _meta ------------------------

async def _raw_call(stack, body: dict[str, Any], headers: dict[str, str] | None = None
                    ) -> tuple[int, Any, dict[str, Any]]:
    async with stack.session.post(stack.proxy_url + "/v1/tool-calls", json=body, headers=headers or {}) as response:
        payload = await response.json()
        assert_envelope(payload)
        return response.status, response.headers, payload


COUNTER = {"counter": "ctr_versions", "delta": 1}


async def test_deprecated_version_answers_with_headers_envelope_metric_and_mcp_meta(proxy_deps, registry_dir):
    versions_v2(registry_dir, v1=DEPRECATED_V1)
    async with running_stack({**proxy_deps, "registry.paths": [str(registry_dir)],
                              "reconcile.enabled": False}) as stack:
        status, headers, env = await _raw_call(stack, {"call_id": "c1", "tool": "adjust_counter",
                                                       "version": "1.0.0", "arguments": COUNTER},
                                               {"X-Run-Id": "run-mcp"})
        assert status == 200 and env["outcome"] == "succeeded" and env["tool_version"] == "1.0.0"
        assert headers["Deprecation"] == "@1793491200"
        assert headers["Sunset"] == "Wed, 31 Mar 2027 00:00:00 GMT"
        assert env["deprecation"] == {"deprecated_at": "2026-11-01", "sunset": "2027-03-31", "replaced_by": "2.0.0"}
        status, headers, env = await _raw_call(stack, {"call_id": "c2", "tool": "adjust_counter",
                                                       "arguments": COUNTER})
        assert env["tool_version"] == "2.0.0" and "deprecation" not in env
        assert "Deprecation" not in headers and "Sunset" not in headers
        # MCP names no version: the run pinned 1.0.0 above, so the MCP call gets it, and says so in _meta
        params = {"name": "adjust_counter", "arguments": COUNTER, "_meta": CLIENT_META}
        status, _, body = await mcp_post(stack, rpc("tools/call", params),
                                         {**modern_headers("tools/call", "adjust_counter"), "X-Run-Id": "run-mcp"})
        assert status == 200 and body["result"]["isError"] is False
        assert body["result"]["_meta"]["io.toolproxy/deprecation"] == env_deprecation()
        status, _, body = await mcp_post(stack, rpc("tools/call", params), modern_headers("tools/call",
                                                                                           "adjust_counter"))
        assert "io.toolproxy/deprecation" not in (body["result"].get("_meta") or {})
        found = samples(await scrape_text(stack))
        calls = {labels: v for (name, labels), v in found.items() if name == "toolproxy_tool_version_calls_total"}
        assert calls[frozenset({("tool", "adjust_counter"), ("version", "1.0.0"), ("status", "deprecated")})] == 2
        assert calls[frozenset({("tool", "adjust_counter"), ("version", "2.0.0"), ("status", "active")})] == 2


def env_deprecation() -> dict[str, Any]:
    return {"deprecated_at": "2026-11-01", "sunset": "2027-03-31", "replaced_by": "2.0.0"}


# -- the run pin -------------------------------------------------------------------------------

def _set_calls(info: dict[str, Any]) -> int:
    return int(info.get("cmdstat_set", {}).get("calls", 0))


async def test_a_run_keeps_its_version_after_the_default_moves_on_until_it_is_retired(proxy_deps, registry_dir):
    async with running_stack({**proxy_deps, "registry.paths": [str(registry_dir)], "reconcile.enabled": False,
                              "registry.reload_interval_ms": 0, "registry.run_pin_ttl_s": 3600}) as stack:
        read = {"order_id": "ord_1001"}
        _, env = await stack.call("get_order", read, headers={"X-Run-Id": "run-a"})
        assert env["tool_version"] == "1.0.0"
        pins = await stack.redis.keys("toolproxy:runpin:*")
        assert len(pins) == 1
        key = pins[0].decode()
        assert key.endswith(":get_order") and await stack.redis.get(key) == b"1.0.0"
        assert 3500 < await stack.redis.ttl(key) <= 3600
        assert key.startswith("toolproxy:runpin:{acme}:")

        versions_v2(registry_dir)  # 2.0.0 active and newer: the registry's default moves on
        assert await stack.runtime.reloader.reload() == "applied"
        _, env = await stack.call("get_order", read, headers={"X-Run-Id": "run-a"})
        assert env["tool_version"] == "1.0.0", "the run keeps the version it started with"
        _, env = await stack.call("get_order", read, headers={"X-Run-Id": "run-b"})
        assert env["tool_version"] == "2.0.0", "a new run starts on the new default"
        _, env = await stack.call("get_order", read)
        assert env["tool_version"] == "2.0.0"

        # round trips: one SET (NX GET EX) per call carrying X-Run-Id, none without
        before = _set_calls(await stack.redis.info("commandstats"))
        await stack.call("get_order", read, headers={"X-Run-Id": "run-a"})
        middle = _set_calls(await stack.redis.info("commandstats"))
        await stack.call("get_order", read)
        after = _set_calls(await stack.redis.info("commandstats"))
        assert (middle - before, after - middle) == (1, 0)

        versions_v2(registry_dir, v1={"status": "retired", "replaced_by": "2.0.0"})
        assert await stack.runtime.reloader.reload() == "applied"
        status, env = await stack.call("get_order", read, headers={"X-Run-Id": "run-a"})
        assert status == 404 and env["error"]["code"] == "tool_not_found"
        assert env["error"]["details"] == {"tool": "get_order", "version": "1.0.0", "reason": "retired",
                                           "replaced_by": "2.0.0"}
        assert await stack.redis.get(key) == b"1.0.0", "a retired pin is not silently moved"
        _, env = await stack.call("get_order", read, headers={"X-Run-Id": "run-a"}, version="2.0.0")
        assert env["outcome"] == "succeeded" and env["tool_version"] == "2.0.0"
        assert await stack.redis.get(key) == b"2.0.0", "re-planned explicitly: the run is pinned anew"
        _, env = await stack.call("get_order", read, headers={"X-Run-Id": "run-a"})
        assert env["tool_version"] == "2.0.0"


# -- reload: refused as a whole, catalog pushed, real processes with polling and SIGHUP ----------

async def test_an_invalid_registry_is_refused_whole_and_a_valid_one_reaches_opa(proxy_deps, registry_dir, opa_server,
                                                                                 caplog):
    async with running_stack({**proxy_deps, "registry.paths": [str(registry_dir)], "reconcile.enabled": False,
                              "registry.reload_interval_ms": 0}) as stack:
        good = (registry_dir / "demo-tools.yaml").read_text()
        write_tools(registry_dir / "v2.yaml", [contract("get_order", "2.0.0"),
                                               contract("refund_order", "2.0.0", mode="sideways")])
        with caplog.at_level(logging.INFO, logger="toolproxy.registry"):
            assert await stack.runtime.reloader.reload() == "refused"
        refused = [r for r in caplog.records if r.name == "toolproxy.registry"]
        assert len(refused) == 1 and refused[0].levelno == logging.ERROR
        assert "registry reload refused" in refused[0].getMessage() and "v2.yaml" in refused[0].getMessage()
        _, env = await stack.call("get_order", {"order_id": "ord_1001"})
        assert env["tool_version"] == "1.0.0", "nothing of the refused registry was applied"
        assert "2.0.0" not in opa_server.query("toolproxy/catalog/tools/get_order")

        write_tools(registry_dir / "v2.yaml", [contract("get_order", "2.0.0")])
        assert (registry_dir / "demo-tools.yaml").read_text() == good
        assert await stack.runtime.reloader.reload() == "applied"
        assert set(opa_server.query("toolproxy/catalog/tools/get_order")) == {"1.0.0", "2.0.0"}
        _, env = await stack.call("get_order", {"order_id": "ord_1001"})
        assert env["outcome"] == "succeeded" and env["tool_version"] == "2.0.0", "OPA knows the new contract"
        reloads = stack.runtime.metrics.registry_reloads
        assert (reloads.labels("refused")._value.get(), reloads.labels("applied")._value.get()) == (1, 1)


async def _metric(session: aiohttp.ClientSession, proc: ProxyProcess, result: str) -> float:
    async with session.get(f"http://127.0.0.1:{proc.ops_port}/metrics") as response:
        found = samples(await response.text())
    return found.get(("toolproxy_registry_reloads_total", frozenset({("result", result)})), 0.0)


async def _version_of_default(session: aiohttp.ClientSession, proc: ProxyProcess) -> str | None:
    async with session.post(proc.url + "/v1/tool-calls", json={"call_id": "c", "tool": "get_order",
                                                               "arguments": {"order_id": "ord_1001"}}) as response:
        return (await response.json())["tool_version"]


async def _reload_seen(session: aiohttp.ClientSession, proc: ProxyProcess, trigger: str, result: str) -> None:
    """Send SIGHUP (or let the poll notice the edit) and wait until the metric counts one ``result``."""
    if trigger == "sighup":
        proc.proc.send_signal(signal.SIGHUP)

    async def counted() -> bool:
        return await _metric(session, proc, result) == 1

    await wait_until(counted, timeout=10, what=f"a registry reload {result}")


@pytest.mark.parametrize("trigger", ["polling", "sighup"])
async def test_a_running_process_reloads_its_registry(proxy_deps, registry_dir, trigger):
    runner, backend_url, _ = await start_demo_backend(keys=session_keys().jwks)
    proc = ProxyProcess({**proxy_deps, "registry.paths": str(registry_dir), "reconcile.enabled": False,
                         "backends.services": {"demo": backend_url},
                         "registry.reload_interval_ms": 100 if trigger == "polling" else 0}).start()
    try:
        await proc.ready()
        async with aiohttp.ClientSession() as session:
            assert await _version_of_default(session, proc) == "1.0.0"
            write_tools(registry_dir / "v2.yaml", [contract("get_order", "2.0.0", risk="sideways")])
            await _reload_seen(session, proc, trigger, "refused")
            assert await _version_of_default(session, proc) == "1.0.0"
            write_tools(registry_dir / "v2.yaml", [contract("get_order", "2.0.0")])
            await _reload_seen(session, proc, trigger, "applied")
            assert await _version_of_default(session, proc) == "2.0.0"
            assert proc.proc.poll() is None
        log = proc.log(20000)
        assert log.count("registry reload refused") == 1 and log.count("registry reloaded") == 1, log
    finally:
        proc.stop()
        await runner.cleanup()


# -- seed 004 §29: history replays across the switch; old and new clients keep uniqueness --------

async def test_recorded_operations_replay_after_version_two_becomes_the_default(proxy_deps, registry_dir):
    async with running_stack({**proxy_deps, "registry.paths": [str(registry_dir)], "reconcile.enabled": False,
                              "registry.reload_interval_ms": 0}) as stack:
        succeeded_args = {"counter": "ctr_hist", "delta": 5}
        _, ok = await stack.call("adjust_counter", succeeded_args, headers={"Idempotency-Key": "k-ok"})
        assert ok["outcome"] == "succeeded" and ok["tool_version"] == "1.0.0"
        denied_args = {"order_id": "ord_2001", "amount": 100, "reason": "other tenant"}
        _, denied = await stack.call("refund_order", denied_args, headers={"Idempotency-Key": "k-deny"})
        assert denied["error"]["code"] == "forbidden", denied
        await stack.fault("adjust_counter", "drop_after_commit", count=1)
        unknown_args = {"counter": "ctr_hist", "delta": 7}
        _, unknown = await stack.call("adjust_counter", unknown_args, headers={"Idempotency-Key": "k-unknown"})
        assert unknown["outcome"] == "unknown"
        _, run_ok = await stack.call("adjust_counter", {"counter": "ctr_run", "delta": 1},
                                     headers={"X-Run-Id": "run-hist"})
        assert run_ok["outcome"] == "succeeded"

        versions_v2(registry_dir, v1=DEPRECATED_V1)
        assert await stack.runtime.reloader.reload() == "applied"
        _, fresh = await stack.call("get_order", {"order_id": "ord_1001"})
        assert fresh["tool_version"] == "2.0.0"
        effects = len(stack.backend.effects)

        # the records stay queryable, under the version they ran with
        _, view = await stack.get(f"/v1/operations/{ok['idempotency_key']}")
        assert (view["state"], view["tool_version"], view["result"]) == ("SUCCEEDED", "1.0.0", ok["data"])
        _, view = await stack.get(f"/v1/operations/{unknown['idempotency_key']}")
        assert (view["state"], view["tool_version"]) == ("UNKNOWN", "1.0.0")

        # old clients (naming 1.0.0) replay the same results; nothing runs again
        _, again = await stack.call("adjust_counter", succeeded_args, headers={"Idempotency-Key": "k-ok"},
                                    version="1.0.0")
        assert again["replayed"] is True and again["data"] == ok["data"] and again["deprecation"]
        _, again = await stack.call("adjust_counter", unknown_args, headers={"Idempotency-Key": "k-unknown"},
                                    version="1.0.0")
        assert again["error"]["code"] == "operation_unknown" and again["idempotency_key"] == unknown["idempotency_key"]
        _, again = await stack.call("refund_order", denied_args, headers={"Idempotency-Key": "k-deny"},
                                    version="1.0.0")
        def same_denial(details):  # each decision has its own id, so the command that explains it differs
            return {k: v for k, v in details.items() if k != "explain"}

        assert (again["error"]["code"], same_denial(again["error"]["details"])) == (
            denied["error"]["code"], same_denial(denied["error"]["details"]))
        assert again["error"]["details"]["explain"].startswith("toolproxy policy explain --decision-id ")
        # the run that started on 1.0.0 names no version and still replays its own operation
        _, again = await stack.call("adjust_counter", {"counter": "ctr_run", "delta": 1},
                                    headers={"X-Run-Id": "run-hist"})
        assert again["replayed"] is True and again["tool_version"] == "1.0.0" and again["data"] == run_ok["data"]
        # a new client reusing the old key under 2.0.0 is refused, not run a second time
        _, clash = await stack.call("adjust_counter", succeeded_args, headers={"Idempotency-Key": "k-ok"})
        assert clash["error"]["code"] == "idempotency_conflict" and clash["tool_version"] == "2.0.0"
        assert len(stack.backend.effects) == effects, "no recorded operation ran again"

        # old and new clients at once, one operation key: exactly one effect at the backend
        race = {"counter": "ctr_mixed", "delta": 1}
        calls = [stack.call("adjust_counter", race, headers={"Idempotency-Key": "k-race", "Prefer": "wait=5"},
                            version="1.0.0" if i % 2 else None) for i in range(8)]
        results = [env for _, env in await asyncio.gather(*calls)]
        ran = [env for env in results if env["outcome"] == "succeeded" and not env.get("replayed")]
        assert len(ran) == 1
        winner = ran[0]["tool_version"]
        for env in results:
            if env is ran[0]:
                continue
            if env["tool_version"] == winner:
                assert env.get("replayed") is True and env["data"] == ran[0]["data"], env
            else:
                assert env["error"]["code"] == "idempotency_conflict", env
        assert stack.backend.counters["ctr_mixed"] == 1
        assert len(stack.backend.effects) == effects + 1
