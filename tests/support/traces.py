"""A real trace backend for tests: Jaeger (v2, built from its Go module by scripts/setup.sh), in memory.

``JaegerServer`` runs ``jaeger`` with an OTLP/HTTP receiver and the query API on free loopback ports;
``trace(trace_id)`` reads a trace back through Jaeger's own query API (``/api/traces/{id}``) as ``Span``
values with their parents resolved. Without the binary the tests that need it skip on a developer's
machine and fail in CI (``CI=true``), where scripts/setup.sh must have built it.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterator

import pytest

from tests.support.servers import BinaryNotFound, _Server, find_binary, free_port

JAEGER_VERSION = "v1.76.0"  # scripts/setup.sh's pin (cmd/jaeger of that module: the v2 binary)


def jaeger_binary() -> str:
    """The jaeger binary; a missing one skips a developer's test run and fails CI's (setup.sh builds it)."""
    try:
        return find_binary("jaeger")
    except BinaryNotFound as exc:
        message = f"jaeger {JAEGER_VERSION} is not installed (scripts/setup.sh builds it when Go is present): {exc}"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


CONFIG = """
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics: {{level: none}}
    logs: {{level: warn}}
extensions:
  healthcheckv2:
    use_v2: true
    http: {{endpoint: "127.0.0.1:{health}"}}
  jaeger_storage:
    backends:
      memstore: {{memory: {{max_traces: 10000}}}}
  jaeger_query:
    storage: {{traces: memstore}}
    http: {{endpoint: "127.0.0.1:{query}"}}
    grpc: {{endpoint: "127.0.0.1:{grpc}"}}
receivers:
  otlp:
    protocols:
      http: {{endpoint: "127.0.0.1:{otlp}"}}
exporters:
  jaeger_storage_exporter: {{trace_storage: memstore}}
"""


@dataclass(frozen=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    tags: dict[str, Any]
    links: tuple[tuple[str, str], ...]   # (trace id, span id) of FOLLOWS_FROM / other-trace references
    events: tuple[dict[str, Any], ...]
    start_us: int = 0
    duration_us: int = 0


class JaegerServer(_Server):
    name = "jaeger"

    def __init__(self, binary: str) -> None:
        super().__init__(None, start_timeout=60.0)
        self.binary = binary
        self.otlp_port, self.health_port, self.grpc_port = free_port(), free_port(), free_port()
        self.config = self._logdir / "jaeger.yaml"
        self.config.write_text(CONFIG.format(health=self.health_port, query=self.port, grpc=self.grpc_port,
                                             otlp=self.otlp_port))

    @property
    def otlp_url(self) -> str:
        return f"http://127.0.0.1:{self.otlp_port}"

    @property
    def query_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _command(self) -> list[str]:
        return [self.binary, "--config", str(self.config)]

    def _is_ready(self) -> bool:
        with urllib.request.urlopen(self.query_url + "/api/services", timeout=1) as answer:
            return answer.status == 200

    def raw_trace(self, trace_id: str) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"{self.query_url}/api/traces/{trace_id}", timeout=5) as answer:
                body = json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        data = body.get("data") or []
        return data[0] if data else None

    def trace(self, trace_id: str) -> list[Span]:
        raw = self.raw_trace(trace_id)
        return [] if raw is None else list(spans_of(raw))


def spans_of(raw: dict[str, Any]) -> Iterator[Span]:
    processes = raw.get("processes") or {}
    for span in raw["spans"]:
        parent = None
        links = []
        for ref in span.get("references") or []:
            if ref["refType"] == "CHILD_OF" and ref["traceID"] == span["traceID"] and parent is None:
                parent = ref["spanID"]
            else:
                links.append((ref["traceID"], ref["spanID"]))
        service = (processes.get(span.get("processID")) or {}).get("serviceName", "")
        yield Span(trace_id=span["traceID"], span_id=span["spanID"], parent_id=parent, name=span["operationName"],
                   service=service, tags={t["key"]: t["value"] for t in span.get("tags") or []},
                   links=tuple(links), events=tuple({f["key"]: f["value"] for f in log.get("fields") or []}
                                                    for log in span.get("logs") or []),
                   start_us=int(span.get("startTime", 0)), duration_us=int(span.get("duration", 0)))


def tree(spans: list[Span]) -> dict[str | None, list[Span]]:
    """Children by parent span id (the root's parent: whatever it points at outside the trace, or None)."""
    children: dict[str | None, list[Span]] = {}
    for span in spans:
        children.setdefault(span.parent_id, []).append(span)
    return children


SHOWN = ("gen_ai.tool.name", "toolproxy.outcome", "error.type", "toolproxy.phase", "toolproxy.decision",
         "toolproxy.side_effect.committed", "toolproxy.idempotency.key_hash", "toolproxy.reconcile.result")


def render(spans: list[Span]) -> str:
    """A trace as an indented tree (name, key attributes, links): what docs/observability.md shows."""
    children = tree(spans)
    ids = {s.span_id for s in spans}
    lines: list[str] = []

    def walk(span: Span, depth: int) -> None:
        shown = " ".join(f"{k}={span.tags[k]}" for k in SHOWN if k in span.tags)
        link = "".join(f" [link -> trace {t[:8]}.. span {s}]" for t, s in span.links)
        took = f"{span.duration_us / 1000:.1f} ms"
        lines.append(f"{'  ' * depth}{span.name}  {took}  {shown}{link}".rstrip())
        for child in sorted(children.get(span.span_id, []), key=lambda c: c.start_us):
            walk(child, depth + 1)

    for root in (s for s in spans if s.parent_id is None or s.parent_id not in ids):
        walk(root, 0)
    return "\n".join(lines)
