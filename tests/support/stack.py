"""In-process proxy + demo backend for tests: real HTTP on loopback, no mocks.

``running_stack()`` starts the demo backend (examples/demo_backend.py) and a
proxy wired to it, and yields a ``Stack`` whose ``call`` posts a tool call
and checks that the envelope validates against schemas/result-envelope.schema.json;
``batch`` does the same for a batch and schemas/batch-response.schema.json.
``running_stack(overrides, share=other)`` starts a second proxy in front of
``other``'s backend (two replicas on one Redis).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Mapping

import aiohttp
from aiohttp import web
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from examples.demo_backend import DemoState, start_demo_backend
from tests.support.calltokens import demo_aliases, session_keys
from proxy.fronts.app import Runtime, admin_app, agent_app, create_runtime, ops_app
from proxy.config import Config, load_config
from proxy.fronts.http_server import EnvelopeRunner
from tests.support.servers import mac_key_file

REPO = Path(__file__).resolve().parent.parent.parent
DEMO_REGISTRY = REPO / "examples" / "registry"
_ENVELOPE_SCHEMA = json.loads((REPO / "schemas" / "result-envelope.schema.json").read_text())
_ENVELOPE = Draft202012Validator(_ENVELOPE_SCHEMA, format_checker=Draft202012Validator.FORMAT_CHECKER)
_BATCH = Draft202012Validator(
    json.loads((REPO / "schemas" / "batch-response.schema.json").read_text()),
    registry=Registry().with_resource(_ENVELOPE_SCHEMA["$id"], Resource.from_contents(_ENVELOPE_SCHEMA)),
    format_checker=Draft202012Validator.FORMAT_CHECKER)


def extra_tools(directory: Path, yaml_text: str) -> dict[str, Any]:
    """Config overrides that load the demo registry plus the tools in ``yaml_text`` (a ``tools:`` document)."""
    path = directory / "extra-tools.yaml"
    path.write_text(yaml_text)
    return {"registry.paths": [str(DEMO_REGISTRY), str(path)]}


def passthrough_read(name: str, path: str, argument: str, extra: str = "", service: str = "demo") -> str:
    """A registry entry (YAML, under ``tools:``) for a read tool that passes one string argument to a demo
    backend path; ``extra`` adds contract lines (e.g. ``quotas: {concurrency: 1}``)."""
    return f"""
  - name: {name}
    version: "1.0.0"
    description: {path} under a contract of the test's own.
    mode: read
    risk: read
    inputSchema:
      type: object
      additionalProperties: false
      required: [{argument}]
      properties: {{{argument}: {{type: string}}}}
    outputSchema: {{type: object}}
    backend: {{type: http, service: {service}, path: {path}}}
    {extra}
"""


# adjust_counter's backend behind a write contract with no resources (nothing to lock) and no required key.
UNLOCKED_COUNTER = """
tools:
  - name: bump_counter
    version: "1.0.0"
    description: adjust_counter without resource locks (tests of stages that run before the lock).
    mode: write
    risk: write
    inputSchema:
      type: object
      additionalProperties: false
      required: [counter, delta]
      properties:
        counter: {type: string, pattern: "^ctr_[A-Za-z0-9_]+$"}
        delta: {type: integer, minimum: -1000, maximum: 1000}
    outputSchema:
      type: object
      additionalProperties: false
      required: [counter, value]
      properties:
        counter: {type: string}
        value: {type: integer}
    timeout_ms: 3000
    backend: {type: http, service: demo, path: /tools/adjust_counter}
"""


def assert_envelope(body: Any) -> None:
    errors = sorted(_ENVELOPE.iter_errors(body), key=lambda e: list(map(str, e.absolute_path)))
    assert not errors, f"envelope violates schema: {[ (list(e.absolute_path), e.message) for e in errors]}"


def mcp_envelope(result: Any) -> dict[str, Any]:
    """The proxy's envelope of an isError MCP CallToolResult (SDK object or raw JSON dict).

    It travels in ``_meta`` and never in ``structuredContent``, which must conform to
    the tool's outputSchema (the TypeScript SDK validates it even on errors)."""
    if isinstance(result, dict):
        assert result["isError"] is True and "structuredContent" not in result, result
        envelope = result["_meta"]["io.toolproxy/envelope"]
    else:
        assert result.is_error is True and result.structured_content is None, result
        envelope = result.meta["io.toolproxy/envelope"]
    assert_envelope(envelope)
    return envelope


def assert_batch(body: Any) -> None:
    errors = sorted(_BATCH.iter_errors(body), key=lambda e: list(map(str, e.absolute_path)))
    assert not errors, f"batch result violates schema: {[(list(e.absolute_path), e.message) for e in errors]}"


@dataclass
class Stack:
    proxy_url: str
    backend_url: str
    backend: DemoState
    runtime: Runtime
    session: aiohttp.ClientSession
    ops_url: str = ""
    admin_url: str = ""
    headers: dict[str, str] = field(default_factory=dict)  # sent with every agent request (e.g. Authorization)
    seq: int = field(default=0)
    # Give every call (and batch) its own Idempotency-Key unless the test sends a key or a run id: writes
    # require a stable operation identity by default (CHANGELOG.md); tests of keyless calls set False.
    auto_key: bool = True
    key_prefix: str = "test-key"  # a second proxy on the same Redis (``share``) gets its own

    @property
    def redis(self) -> Any:
        return self.runtime.redis

    async def call(self, tool: str, arguments: Any, *, call_id: str | None = None,
                   headers: Mapping[str, str] | None = None, version: str | None = None
                   ) -> tuple[int, dict[str, Any]]:
        self.seq += 1
        body: dict[str, Any] = {"call_id": call_id or f"call_{self.seq}", "tool": tool, "arguments": arguments}
        if version is not None:
            body["version"] = version
        return await self.post("/v1/tool-calls", body, headers=self._keyed(headers))

    def _keyed(self, headers: Mapping[str, str] | None) -> Mapping[str, str] | None:
        given = {**self.headers, **(headers or {})}
        if not self.auto_key or "Idempotency-Key" in given or "X-Run-Id" in given:
            return headers
        return {"Idempotency-Key": f"{self.key_prefix}-{self.seq}", **(headers or {})}  # (each test's Redis is flushed)

    async def batch(self, calls: list[dict[str, Any]], *, headers: Mapping[str, str] | None = None
                    ) -> tuple[int, dict[str, Any]]:
        """POST /v1/tool-calls:batch; a 200 answer is checked against the batch response schema."""
        self.seq += 1
        status, body = await self.post("/v1/tool-calls:batch", {"calls": calls}, headers=self._keyed(headers))
        if status == 200:
            assert_batch(body)
        return status, body

    async def get(self, path: str, *, admin: bool = False,
                  headers: Mapping[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        base = self.admin_url if admin else self.proxy_url
        async with self.session.get(base + path, headers={**({} if admin else self.headers),
                                                         **(headers or {})}) as response:
            return response.status, await response.json(content_type=None)

    async def post(self, path: str, body: Any, *, headers: Mapping[str, str] | None = None,
                   raw: bytes | None = None, content_type: str = "application/json") -> tuple[int, dict[str, Any]]:
        data = raw if raw is not None else json.dumps(body).encode()
        async with self.session.post(self.proxy_url + path, data=data,
                                     headers={"Content-Type": content_type, **self.headers,
                                              **(headers or {})}) as response:
            payload = await response.json(content_type=None)
        if "outcome" in payload:
            assert_envelope(payload)
        return response.status, payload

    async def admin(self, method: str, path: str, token: str | None) -> tuple[int, dict[str, Any]]:
        """A request to the admin listener (approvals) with an optional bearer token."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.session.request(method, self.admin_url + path, headers=headers) as response:
            return response.status, await response.json(content_type=None)

    async def fault(self, tool: str, mode: str, **extra: Any) -> None:
        async with self.session.post(self.backend_url + "/_control/faults",
                                     json={"tool": tool, "mode": mode, **extra}) as response:
            assert response.status == 200, await response.text()


@contextlib.asynccontextmanager
async def running_stack(overrides: Mapping[str, Any] | None = None, *,
                        share: Stack | None = None) -> AsyncIterator[Stack]:
    """Overrides must point ``opa.url`` and ``redis.url`` at real servers (the
    ``proxy_deps`` fixture has both) and may set identity settings. With
    ``share`` the proxy uses that stack's demo backend instead of starting one."""
    if share is None:
        backend_runner, backend_url, state = await start_demo_backend(keys=session_keys().jwks)
    else:
        backend_runner, backend_url, state = None, share.backend_url, share.backend
    config: Config = load_config(env={}, overrides={
        "integrity.mac_key_file": mac_key_file(),  # every proxy of a test run shares one, as a fleet does
        "identity.mode": "static",  # tests opt into static identity; the product default is jwt
        "backends.services": {"demo": backend_url},
        # a connect to a backend on loopback is refused or taken at once; the product's 1 s cap only turns a
        # stalled event loop on a loaded test machine into timeout_not_started (seen once in CI)
        "backends.connect_timeout_ms": 10_000,
        # likewise a decision: tests of OPA's own lateness set a short opa.timeout_ms of their own
        "opa.timeout_ms": 5_000,
        "registry.paths": [str(DEMO_REGISTRY)],
        **session_keys().settings(),  # the demo backend verifies the call tokens this key signs
        **(overrides or {}),
    })
    try:
        runtime = await create_runtime(config)
    except BaseException:  # refused at start-up (a test may expect that): the backend stops too
        if backend_runner is not None:
            await backend_runner.cleanup()
        raise
    state.aliases.update(demo_aliases(runtime.registry.all()))  # a test's contracts on demo tools' routes
    runner = EnvelopeRunner(agent_app(runtime), count_refusal=runtime.count_refusal)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    ops_runner = EnvelopeRunner(ops_app(runtime), count_refusal=runtime.count_refusal)
    await ops_runner.setup()
    await web.TCPSite(ops_runner, "127.0.0.1", 0).start()
    admin_runner = EnvelopeRunner(admin_app(runtime), count_refusal=runtime.count_refusal)
    await admin_runner.setup()
    await web.TCPSite(admin_runner, "127.0.0.1", 0).start()
    session = aiohttp.ClientSession()
    try:
        yield Stack(proxy_url=f"http://127.0.0.1:{port}", backend_url=backend_url, backend=state,
                    runtime=runtime, session=session, ops_url=f"http://127.0.0.1:{ops_runner.addresses[0][1]}",
                    admin_url=f"http://127.0.0.1:{admin_runner.addresses[0][1]}",
                    key_prefix="test-key" if share is None else f"test-key-{uuid.uuid4().hex[:8]}")
    finally:
        await session.close()
        await admin_runner.cleanup()
        await ops_runner.cleanup()
        await runner.cleanup()
        await runtime.close()
        if backend_runner is not None:
            await backend_runner.cleanup()
