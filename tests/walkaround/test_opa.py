"""Walk-around: the agent container asks OPA directly (issue 28, item 4).

OPA runs as the chart, ``toolproxy dev`` and every test run it: ``--authentication=token
--authorization=basic`` with proxy/policy/opa_authz.rego. Without the proxy's token a data read (every
tenant's subjects, roles, thresholds) and a decision query get 401; with it, the decision path answers and
nothing else does. A proxy without the token fails closed (``policy_unavailable``).
"""

from __future__ import annotations

import json

from tests.support.stack import running_stack


def ask(opa, method: str, path: str, body: bytes | None = None, token: str | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    return opa.request(method, path, body, headers)[0]


DECISION = "/v1/data/toolproxy/decision"
QUERY = json.dumps({"input": {}}).encode()


def test_without_the_token_a_data_read_or_a_decision_query_gets_401(opa_server):
    assert ask(opa_server, "GET", "/v1/data/toolproxy") == 401
    assert ask(opa_server, "GET", "/v1/data") == 401
    assert ask(opa_server, "POST", DECISION, QUERY) == 401
    assert ask(opa_server, "POST", "/v1/query", json.dumps({"query": "data.toolproxy"}).encode()) == 401
    assert ask(opa_server, "PUT", "/v1/policies/evil", b"package evil\n") == 401
    assert ask(opa_server, "POST", DECISION, QUERY, token="guessed") == 401
    assert ask(opa_server, "GET", "/health") == 200  # probes carry no data


def test_the_proxys_token_asks_decisions_and_nothing_else(opa_server):
    token = opa_server.token
    assert ask(opa_server, "POST", DECISION, QUERY, token=token) == 200
    assert ask(opa_server, "GET", "/v1/data/toolproxy", token=token) == 401
    assert ask(opa_server, "GET", "/v1/data/toolproxy/decision/allow/x", token=token) == 401
    assert ask(opa_server, "PUT", "/v1/policies/evil", b"package evil\n", token=token) == 401
    assert ask(opa_server, "GET", "/v1/policies", token=token) == 401


async def test_a_proxy_without_the_token_fails_closed(proxy_deps):
    settings = {key: value for key, value in proxy_deps.items() if key != "opa.token_file"}
    async with running_stack(settings) as stack:
        status, env = await stack.call("get_order", {"order_id": "ord_1001"})
        assert status == 503 and env["error"]["code"] == "policy_unavailable", env
        assert stack.backend.requests == []


async def test_a_proxy_with_the_token_is_answered(proxy_deps):
    async with running_stack(proxy_deps) as stack:
        status, env = await stack.call("get_order", {"order_id": "ord_1001"})
        assert status == 200, env
