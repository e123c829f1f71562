"""A deployment imports what it uses (issue 32): the MCP SDK (and its pydantic models), policy authoring
and the dev stack are not imported by a process that does not serve MCP, call an MCP upstream or author
policy. Each check runs in a fresh interpreter and reads its ``sys.modules`` (nothing is timed); the
``OnFirstUse`` pattern itself is tests/unit/test_lazy.py's."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.unit import REPO

# What the serving path of a JSON/OpenAI-only process must not pull in (opa-python-client, with requests and
# urllib3 for its synchronous twin, is the authoring commands' client: the proxy's own OPA control plane is
# two requests over its aiohttp session).
NOT_IMPORTED = ("mcp", "mcp_types", "pydantic", "httpx2", "proxy.fronts.mcp", "proxy.adapters.mcp", "proxy.wire.mcp",
                "proxy.authoring", "proxy.authoring.devstack", "proxy.authoring.policy_commands",
                "opa_client", "requests", "urllib3",
                # redis-py's first import reaches for it; proxy/wire/redis_py.py makes that import skip it.
                "opentelemetry.sdk.metrics")


def imported_after(code: str) -> set[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_the_run_entry_without_an_mcp_configuration_does_not_import_mcp():
    modules = imported_after("import proxy.fronts.app, proxy.cli, proxy.process.runtime")
    assert not modules & set(NOT_IMPORTED), sorted(modules & set(NOT_IMPORTED))


def test_the_run_command_imports_no_authoring_before_it_serves():
    # main() builds every subcommand's parser, then `run` imports the serving path (a missing config file
    # stops it right after, before anything is opened): policy authoring's parsers live in proxy/cli.py.
    modules = imported_after("from proxy.cli import main\nmain(['run', '--config', '/nonexistent/toolproxy.yaml'])")
    assert "proxy.fronts.app" in modules  # the serving path was imported: the probe ran far enough
    assert not modules & set(NOT_IMPORTED), sorted(modules & set(NOT_IMPORTED))


def test_the_mcp_front_brings_the_sdk_when_it_is_imported():  # the check above can fail: it sees the SDK
    assert {"mcp", "mcp_types"} <= imported_after("import proxy.fronts.mcp.front")
