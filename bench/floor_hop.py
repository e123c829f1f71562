"""The floor of this design: a bare aiohttp hop that POSTs once to OPA and once to the backend.

It does what no proxy of this shape can avoid — read the request, ask OPA
with the same input document the proxy builds (``proxy.policy.client.build_input``),
call the backend with a signed call token (the demo backend, like any backend that verifies, accepts
nothing less: ``proxy.calltokens.signer``, one signature per request), answer — and nothing else (no schemas, no Redis, no
metrics, no audit). ``bench.floor`` runs it beside the proxy in the same run,
on the same event loop implementation the proxy uses, so the ratios compare
the pipeline's own work with the hops it cannot avoid. Two clients for the two
hops: aiohttp's (``--client aiohttp``, the floor any aiohttp service has) and the
proxy's own HTTP wire (``--client wire``, ``proxy.wire.http``: the floor of the
proxy's own hops, so a ratio against it is what the pipeline adds, not what a
client library costs).

    python -m bench.floor_hop --port P --opa URL --backend URL --signing-key PEM [--opa-token-file F] [--client aiohttp|wire]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
import uuid

import aiohttp
from aiohttp import web

from proxy.calltokens.keys import load_signing_key
from proxy.calltokens.signer import CallTokenSigner
from proxy.cli import run_loop
from proxy.identity import Caller
from proxy.normalize import normalize
from proxy.policy.client import STRICT, RequestFacts, build_input, catalog_document
from proxy.registry import load_registry
from proxy.wire.http import HttpWire

from bench.servers import REPO


def _input_template() -> dict:
    registry = load_registry([str(REPO / "examples" / "registry")])
    tool = registry.resolve("get_order", None)
    caller = Caller(subject="dev-user", tenant="acme", roles=("agent",), scopes=("tools:read", "tools:write"),
                    agent="dev-agent", source="static")
    return build_input("call", caller, RequestFacts(request_id="req", call_id="c1"),
                       catalog_digest=catalog_document(registry)["digest"], tool=tool,
                       normalized=normalize(tool, {"order_id": "ord_1001"}))


def build_app(opa_url: str, backend_url: str, signing_key: str, opa_token: str = "",
              client: str = "aiohttp") -> web.Application:
    template = _input_template()
    signer = CallTokenSigner(load_signing_key(signing_key), issuer="toolproxy")
    decision_url = opa_url.rstrip("/") + "/v1/data/toolproxy/decision" + STRICT  # the proxy's query, exactly
    # OPA answers the proxy's bearer token only: the floor sends it as the proxy does.
    opa_headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {opa_token}"} if opa_token else {})}
    app = web.Application()

    async def hop(request: web.Request) -> web.Response:
        body = await request.json()
        document = {**template, "arguments": body["arguments"],
                    "request": {**template["request"], "call_id": body["call_id"]}}
        decision = await post(decision_url, json.dumps({"input": document}).encode(), opa_headers)
        if not decision.get("result", {}).get("allow"):  # type: ignore[attr-defined]
            return web.json_response({"outcome": "failed"}, status=403)
        arguments = json.dumps(body["arguments"], separators=(",", ":"), sort_keys=True).encode()
        token = signer.sign(audience="demo", scope="tool:call", txn=uuid.uuid4().hex, subject="dev-user",
                            tenant="acme", agent="dev-agent", budget_s=10.0,
                            context={"tool": body["tool"], "version": "1.0.0",
                                     "args_hash": hashlib.sha256(arguments).hexdigest(), "call_id": body["call_id"]})
        data = await post(f"{backend_url}/tools/{body['tool']}", arguments,
                          {"Content-Type": "application/json", "Txn-Token": token})
        return web.json_response({"outcome": "succeeded", "data": data})

    async def post(url: str, body: bytes, headers: dict[str, str]) -> object:
        if client == "wire":
            wire: HttpWire = app["wire"]
            return json.loads((await wire.post(url, body, headers.items())).body)
        session: aiohttp.ClientSession = app["session"]
        async with session.post(url, data=body, headers=headers) as response:
            return await response.json()

    async def session_ctx(app: web.Application):
        app["session"] = aiohttp.ClientSession()
        app["wire"] = HttpWire()
        yield
        await app["session"].close()
        await app["wire"].close()

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/", hop)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--opa", required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--opa-token-file", default="")
    parser.add_argument("--signing-key", required=True, help="PEM key the call tokens are signed with")
    parser.add_argument("--client", choices=("aiohttp", "wire"), default="aiohttp",
                        help="the client of the two hops: aiohttp's, or the proxy's own HTTP wire")
    args = parser.parse_args()
    token = Path(args.opa_token_file).read_text().strip() if args.opa_token_file else ""

    async def serve() -> None:
        runner = web.AppRunner(build_app(args.opa, args.backend, args.signing_key, token, args.client), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port).start()
        import asyncio
        await asyncio.Event().wait()

    run_loop(serve())


if __name__ == "__main__":
    main()
