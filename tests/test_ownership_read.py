"""Ownership read at the call: a resource kind with more ids than OPA data could list (``ownership:
at_write``) is checked by a read of the system of record that the proxy runs under the call's lock, right
before sending (the contract's ``ownership_read``). Real OPA, Redis and the proxy; the backend is a small
aiohttp app of this file that knows which tenant owns each document (none of it in OPA data).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.support.stack import running_stack

OWNERS = {"doc_1": "acme", "doc_2": "globex"}

REGISTRY = """
tools:
  - name: doc_owner
    version: "1.0.0"
    description: Which tenant owns a document (the system of record).
    mode: read
    risk: read
    inputSchema:
      type: object
      additionalProperties: false
      required: [doc_id]
      properties: {doc_id: {type: string, pattern: "^doc_[0-9]+$"}}
    outputSchema:
      type: object
      additionalProperties: false
      required: [tenant]
      properties: {tenant: {type: string}}
    backend: {type: http, service: docs, path: /tools/doc_owner}
  - name: edit_doc
    version: "1.0.0"
    description: Change a document.
    mode: write
    risk: write
    inputSchema:
      type: object
      additionalProperties: false
      required: [doc_id, text]
      properties:
        doc_id: {type: string, pattern: "^doc_[0-9]+$"}
        text: {type: string, maxLength: 100}
    outputSchema: {type: object}
    resources:
      - template: "doc:{doc_id}"
    ownership_read: {tool: doc_owner, version: "1.0.0", arguments: {doc_id: /arguments/doc_id}, tenant: /tenant}
    idempotency: {required: true}
    backend: {type: http, service: docs, path: /tools/edit_doc}
"""


@pytest.fixture
async def docs_backend():
    edits: list[dict[str, Any]] = []
    owner_reads: list[str] = []

    async def doc_owner(request: web.Request) -> web.Response:
        doc_id = (await request.json())["doc_id"]
        owner_reads.append(doc_id)
        return web.json_response({"tenant": OWNERS[doc_id]})

    async def edit_doc(request: web.Request) -> web.Response:
        edits.append(await request.json())
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/tools/doc_owner", doc_owner)
    app.router.add_post("/tools/edit_doc", edit_doc)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", edits, owner_reads
    finally:
        await runner.cleanup()


async def test_the_owner_read_at_the_call_lets_the_own_tenant_write_and_refuses_another_unsent(
        proxy_deps, docs_backend, tmp_path: Path):
    url, edits, owner_reads = docs_backend
    registry = tmp_path / "docs.yaml"
    registry.write_text(REGISTRY)
    async with running_stack({**proxy_deps, "registry.paths": [str(registry)], "backends.services": {"docs": url},
                              "reconcile.enabled": False}) as stack:
        stack.auto_key = True
        status, env = await stack.call("edit_doc", {"doc_id": "doc_1", "text": "hello"})
        assert status == 200 and env["outcome"] == "succeeded", env
        assert [e["doc_id"] for e in edits] == ["doc_1"] and owner_reads == ["doc_1"]

        status, env = await stack.call("edit_doc", {"doc_id": "doc_2", "text": "mine now"})
        assert status == 403 and env["error"]["code"] == "forbidden", env
        assert env["side_effect"] == {"attempted": False, "committed": False}
        assert "globex" not in str(env)  # the owner is not shown to the caller
        assert [e["doc_id"] for e in edits] == ["doc_1"] and owner_reads == ["doc_1", "doc_2"]  # read, not sent


async def test_a_contract_that_reads_no_owner_cannot_touch_an_at_write_kind(proxy_deps, docs_backend, tmp_path):
    url, edits, owner_reads = docs_backend
    registry = tmp_path / "docs.yaml"
    registry.write_text(REGISTRY.replace(
        '    ownership_read: {tool: doc_owner, version: "1.0.0", arguments: {doc_id: /arguments/doc_id}, '
        'tenant: /tenant}\n', ""))
    async with running_stack({**proxy_deps, "registry.paths": [str(registry)], "backends.services": {"docs": url},
                              "reconcile.enabled": False}) as stack:
        stack.auto_key = True
        status, env = await stack.call("edit_doc", {"doc_id": "doc_1", "text": "hello"})
        assert status == 403 and env["error"]["code"] == "forbidden", env
        assert not edits and not owner_reads
