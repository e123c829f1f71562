"""Shared pytest fixtures for toolproxy.

Sections:
  * Real servers (OPA, Redis) -- started as subprocesses via tests/support/servers.py.
    Binaries come from .venv/bin (installed by scripts/setup.sh) or PATH.
  * (Proxy / demo-backend fixtures are appended below by their authors.)

pytest configuration (asyncio mode, markers, ...) lives in pyproject.toml
under [tool.pytest.ini_options]; this file deliberately sets none.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.servers import OpaServer, RedisServer
from tests.support.tokens import Issuer

REPO_ROOT = Path(__file__).resolve().parent.parent
POLICIES_DIR = REPO_ROOT / "policies"
DEMO_OPA_DATA = REPO_ROOT / "examples" / "opa"


# ---------------------------------------------------------------------------
# Real servers: OPA and Redis
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def opa_server():
    """A real OPA server for the whole session.

    Loads the repo's ``policies/`` directory if it exists (nothing otherwise)
    and the demo data the dev stack uses (``examples/opa/``: roles, resource
    ownership, thresholds for the demo registry).
    Tests may add policies/data with ``opa_server.put_policy`` /
    ``opa_server.put_data``; use ids/paths unique to the test to avoid
    interfering with others. A test that stops the server must start it again
    (``opa_server.start()``) before finishing.
    """
    paths = [p for p in (POLICIES_DIR, DEMO_OPA_DATA) if p.is_dir()]
    server = OpaServer(paths)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server (or valkey-server) for the whole session, no persistence."""
    server = RedisServer(data_dir=tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server):
    """URL of the session Redis, with the database flushed before the test."""
    if not redis_server.running:  # a previous test stopped it
        redis_server.start()
    redis_server.flushall()
    return redis_server.url


# ---------------------------------------------------------------------------
# Audit records: every record any test writes to stdout must match its schema
# ---------------------------------------------------------------------------

_AUDIT_SEEN = {"records": 0}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """At teardown, validate the audit lines in everything the test printed (setup, call, teardown)."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "teardown":
        return
    from tests.support.audit import violations
    found, problems = violations(report.capstdout)
    _AUDIT_SEEN["records"] += found
    if problems and report.outcome == "passed":
        report.outcome = "failed"
        report.longrepr = "audit records violate schemas/audit-record.schema.json:\n" + "\n".join(problems[:20])


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"audit records validated against schemas/audit-record.schema.json: "
                                f"{_AUDIT_SEEN['records']} (captured stdout of every test)")


@pytest.fixture
def proxy_deps(opa_server, redis_url):
    """Config overrides that point an in-process proxy at the session OPA and a flushed Redis."""
    if not opa_server.running:  # a previous test stopped it
        opa_server.start()
    return {"opa.url": opa_server.url, "redis.url": redis_url}


@pytest.fixture(scope="session")
def issuers(tmp_path_factory):
    """Two real JWT issuers with their own keys: the agent's platform, and the admins' (approvers/operators)."""
    directory = tmp_path_factory.mktemp("keys")
    return (Issuer(directory, issuer="https://platform.test", kid="agent-key"),
            Issuer(directory, issuer="https://admins.test", kid="admin-key"))


@pytest.fixture
async def jwt_stack(proxy_deps, issuers):
    """An in-process proxy with real JWTs (agent ``alice`` of acme signs every agent request), no reconciler."""
    from tests.support.stack import running_stack
    from tests.support.tokens import jwt_overrides

    agent, admin = issuers
    async with running_stack({**proxy_deps, **jwt_overrides(agent, admin), "reconcile.enabled": False}) as stack:
        stack.headers["Authorization"] = f"Bearer {agent.token('alice')}"
        yield stack


@pytest.fixture
async def backend():
    """The demo tool backend in this process, for tests whose proxies run as processes: (base URL, state)."""
    from examples.demo_backend import start_demo_backend

    runner, url, state = await start_demo_backend()
    try:
        yield url, state
    finally:
        await runner.cleanup()
