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
from tests.support.topologies import RedisClusterGroup, SentinelGroup
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


def _running(group):
    try:
        yield group.start()
    finally:
        group.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A 6-node Redis Cluster (3 masters, 3 replicas) for the whole session, started on first use."""
    yield from _running(RedisClusterGroup(tmp_path_factory.mktemp("cluster")))


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory):
    """A Sentinel group (1 master, 1 replica, 3 Sentinels) for the whole session, started on first use."""
    yield from _running(SentinelGroup(tmp_path_factory.mktemp("sentinel")))


@pytest.fixture
def redis_mode(request):
    """standalone, unless a test is parametrized over the modes (``tests.support.modes.all_redis_modes``)."""
    return getattr(request, "param", "standalone")


@pytest.fixture
def redis_settings(request, redis_mode):
    """The proxy's ``redis.*`` settings for the mode, on flushed data (a killed node restored first)."""
    if redis_mode == "standalone":
        return {"redis.url": request.getfixturevalue("redis_url")}
    group = request.getfixturevalue("redis_cluster" if redis_mode == "cluster" else "redis_sentinel")
    group.restore()
    group.flushall()
    return group.overrides()


@pytest.fixture
def proxy_deps(opa_server, redis_settings):
    """Config overrides that point an in-process proxy at the session OPA and a flushed Redis (of the mode),
    signing call tokens with the session's test key (tests/support/calltokens.py)."""
    if not opa_server.running:  # a previous test stopped it
        opa_server.start()
    from tests.support.calltokens import session_keys
    return {**opa_server.settings, **redis_settings, **session_keys().settings()}


@pytest.fixture
async def state_client(redis_settings):
    """The proxy's own kind of Redis client for the mode (standalone, Sentinel or Cluster), for inspection."""
    from proxy.config import load_config
    from proxy.store import close_client, create_client
    client = create_client(load_config(env={}, overrides=redis_settings).redis)
    try:
        yield client
    finally:
        await close_client(client)


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


# ---------------------------------------------------------------------------
# Tool backends and HTTP clients for tests that drive real proxy processes
# ---------------------------------------------------------------------------


@pytest.fixture
async def demo_backend():
    """The demo tool backend in this event loop: ``(url, state)``; it verifies the call tokens of
    ``session_keys()`` (``proxy_deps`` signs with that key)."""
    from examples.demo_backend import start_demo_backend
    from tests.support.calltokens import session_keys
    runner, url, state = await start_demo_backend(keys=session_keys().jwks)
    try:
        yield url, state
    finally:
        await runner.cleanup()


@pytest.fixture
async def http_session():
    """A client session for talking to proxy processes (tests/support/proxyproc.py)."""
    import aiohttp
    async with aiohttp.ClientSession() as session:
        yield session
