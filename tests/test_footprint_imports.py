"""A JSON/OpenAI-only sidecar imports what it uses (issue 32), also while it serves: a real ``toolproxy run``
process (``mcp.front`` off, no MCP upstream) answers probes, a scrape and calls through both of its fronts
(a read, a write, a refused call, an OpenAI-shaped read), then stops on SIGTERM and writes the names in its
``sys.modules`` and its collector's state (an ``atexit`` hook of the probe that runs it). Nothing here is
timed."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp

from examples.demo_backend import start_demo_backend
from tests.support.calltokens import session_keys
from tests.support.proxyproc import REPO, ProxyProcess
from tests.test_lazy_imports import NOT_IMPORTED



class ReportingProxy(ProxyProcess):
    """``toolproxy run`` that writes its imported modules' names to ``modules_file`` when it exits."""

    def __init__(self, settings: dict) -> None:
        super().__init__(settings)
        self.modules_file = Path(tempfile.mkdtemp(prefix="toolproxy-modules-")) / "modules.json"

    def start(self) -> "ReportingProxy":
        probe = ("import atexit, json, runpy, sys\n"
                 "import gc\n"
                 f"atexit.register(lambda: open({str(self.modules_file)!r}, 'w').write(json.dumps(\n"
                 "    {'modules': sorted(sys.modules), 'gc': [gc.get_threshold(), gc.get_freeze_count()]})))\n"
                 "sys.argv = ['toolproxy', 'run']\n"
                 "runpy.run_module('proxy.cli', run_name='__main__')\n")
        with open(self._log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", probe], cwd=REPO, env=self.env,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        return self

    def report(self) -> tuple[set[str], list]:
        """Stops the process: its imported modules' names, and its collector's thresholds and frozen objects."""
        self.stop()
        assert self.proc is not None and self.proc.returncode == 0, self.log()
        report = json.loads(self.modules_file.read_text())
        return set(report["modules"]), report["gc"]


async def test_a_serving_json_only_sidecar_imports_no_mcp_no_authoring_no_opa_client(proxy_deps):
    runner, backend_url, _ = await start_demo_backend(keys=session_keys().jwks)
    proxy = ReportingProxy({**proxy_deps, "backends.services": {"demo": backend_url}, "mcp.front": False,
                            "registry.paths": str(REPO / "examples" / "registry"), "log.level": "warning"}).start()
    try:
        await proxy.ready()
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            ops = f"http://127.0.0.1:{proxy.ops_port}"
            for path in ("/readyz", "/metrics", "/healthz"):
                async with session.get(ops + path) as answer:
                    assert answer.status == 200, path
            calls = [({"call_id": "c1", "tool": "get_order", "arguments": {"order_id": "ord_1001"}}, {}, 200),
                     ({"call_id": "c2", "tool": "adjust_counter", "arguments": {"counter": "ctr_fp", "delta": 1}},
                      {"Idempotency-Key": "footprint-imports-1"}, 200),
                     ({"call_id": "c3", "tool": "get_order", "arguments": {"order_id": 7}}, {}, 422)]
            for body, headers, status in calls:
                async with session.post(proxy.url + "/v1/tool-calls", json=body, headers=headers) as answer:
                    assert answer.status == status, await answer.text()
            openai = {"tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_order", "arguments": json.dumps({"order_id": "ord_1001"})}}]}
            async with session.post(proxy.url + "/v1/openai/tool-calls", json=openai) as answer:
                assert answer.status == 200, await answer.text()
            async with session.post(proxy.url + "/mcp", json={}) as answer:
                assert answer.status == 404  # no MCP front
        modules, (thresholds, frozen) = proxy.report()
    finally:
        proxy.stop()
        await runner.cleanup()
    assert {"proxy.fronts.app", "proxy.fronts.openai", "proxy.pipeline"} <= modules  # the probe saw a sidecar
    assert not modules & set(NOT_IMPORTED), sorted(modules & set(NOT_IMPORTED))
    assert "difflib" not in modules  # proxy/drift.py diffs a drifted MCP upstream's definition only
    # proxy/startup.py: what the start-up built was frozen once the listeners were up, and the collector runs
    # with its usual thresholds while serving.
    assert tuple(thresholds) == gc.get_threshold() and frozen > 20000, (thresholds, frozen)
