"""The DNS-rebinding guard of the agent listener (proxy/fronts/rebinding.py): a request's ``Host`` and
``Origin`` against ``mcp.allowed_hosts`` / ``mcp.allowed_origins``."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request

from proxy.config import McpConfig
from proxy.fronts.rebinding import HostGuard, host_allowed, origin_allowed

HOSTS = frozenset({"localhost", "127.0.0.1:8080", "[::1]"})
ORIGINS = frozenset({"http://localhost", "https://app.example:8443"})


@pytest.mark.parametrize("host, allowed", [
    ("localhost", True), ("LOCALHOST:9999", True), (" localhost ", True),  # a bare name allows any port
    ("127.0.0.1:8080", True), ("127.0.0.1:8081", False), ("127.0.0.1", False),  # name:port allows that port
    ("[::1]:8080", True), ("[::1]", True),
    ("evil.example", False), ("localhost.evil.example", False), ("", False), (None, False),
])
def test_a_host_is_a_listed_name_on_any_port_or_a_listed_name_and_port(host, allowed):
    assert host_allowed(host, HOSTS) is allowed


def test_a_wildcard_allows_every_host_and_origin_even_none():
    assert host_allowed(None, frozenset({"*"})) and origin_allowed("null", frozenset({"*"}))


@pytest.mark.parametrize("origin, allowed", [
    ("http://localhost", True), ("http://localhost:3000", True), ("HTTP://LocalHost", True),
    ("https://localhost", False),  # the scheme is part of the origin
    ("https://app.example:8443", True), ("https://app.example", False), ("https://app.example:9443", False),
    ("http://evil.example", False), ("null", False), ("http://[::1", False),  # unparsable: refused, not raised
])
def test_an_origin_is_a_listed_scheme_and_name_on_any_port_or_exactly_a_listed_one(origin, allowed):
    assert origin_allowed(origin, ORIGINS) is allowed


def guard(hosts: list[str], origins: list[str]) -> HostGuard:
    return HostGuard(McpConfig(allowed_hosts=hosts, allowed_origins=origins))


def test_the_guard_names_the_setting_that_refuses_and_passes_a_request_without_origin():
    hosts, origins = ["LocalHost"], ["HTTP://LOCALHOST/"]  # compared lower-case, the origin's slash dropped
    ok = make_mocked_request("POST", "/v1/tool-calls", headers={"Host": "localhost:8080"})
    assert guard(hosts, origins).refusal(ok) is None
    same_origin = make_mocked_request("POST", "/v1/tool-calls",
                                      headers={"Host": "localhost", "Origin": "http://localhost:5173"})
    assert guard(hosts, origins).refusal(same_origin) is None
    assert "mcp.allowed_hosts" in guard(hosts, origins).refusal(
        make_mocked_request("GET", "/", headers={"Host": "attacker.example"}))
    assert "mcp.allowed_origins" in guard(hosts, origins).refusal(
        make_mocked_request("GET", "/", headers={"Host": "localhost", "Origin": "http://attacker.example"}))
