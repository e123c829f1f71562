"""Decision records: the exact OPA input of each policy decision, for replay by policy authors.

Owns: the shape of a decision record (``schemas/decision-record.schema.json``):
the OPA input as sent, its arguments as the contract's record view keeps them
(what it shows in clear, keyed fingerprints of the rest, as audit records do)
and every fingerprinted path listed; the decision, the policy revision and
OPA's decision id; the sinks (a Redis Stream trimmed by length and by age,
stdout JSON lines) and the record-size bound (an oversized record keeps its
decision and drops its input, saying so).

Must never: record in clear an argument value the contract does not show,
truncate a value silently (a truncated input would replay as a different call:
the record drops the whole input instead), or let a failed write change a
call's outcome or delay it past ``decisions.timeout_ms``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence


from ..audit import StdoutSink, iso_now
from ..telemetry import record_view
from ..telemetry.record_view import EACH_VALUE_HIDDEN, RecordView
from ..config import ConfigError, DecisionsConfig
from ..telemetry.metrics import Metrics
from ..store import STORE_OR_SOCKET_FAULTS, Client, logged_on_fault, redis_call

log = logging.getLogger("toolproxy.decisions")

RECORD_TYPE = "toolproxy.decision.v1"
SINKS = frozenset({"redis", "stdout"})
SINK_FAULTS = (*STORE_OR_SOCKET_FAULTS, ValueError)  # a sink's write: Redis, a pipe, a line it cannot take

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Decision:
    """One answer of the policy (``proxy/policy/client.py`` builds it from OPA's result; recorded here)."""

    allow: bool
    require_approval: bool
    reasons: tuple[str, ...]
    risk: str
    policy_revision: str | None = None
    decision_id: str | None = None
    visible_tools: tuple[str, ...] = ()
    quota_class: str | None = None  # the caller's quota class, when the policy names one (docs/quotas.md)

    @property
    def result(self) -> str:
        return "allow" if self.allow else "require_approval" if self.require_approval else "deny"


def mask_input(document: Mapping[str, Any], view: RecordView, key: bytes) -> tuple[dict[str, Any], list[Path]]:
    """A copy of the OPA input whose ``arguments`` are as the contract's record view keeps them (values it
    does not show replaced by their keyed fingerprints: proxy/telemetry/record_view.py), and the path of each
    replaced value from the input's root: ``["arguments", "items", 0, "pin"]``."""
    out = dict(document)
    if isinstance(document.get("arguments"), dict):
        out["arguments"], masked = record_view.apply(document["arguments"], view, key, at=("arguments",))
        return out, masked
    return out, []


def build_record(document: Mapping[str, Any], decision: Decision, *, decision_path: str, view: RecordView,
                 key: bytes, max_bytes: int) -> dict[str, Any]:
    masked_input, masked_paths = mask_input(document, view, key)
    tool = document.get("tool") or {}
    subject = document.get("subject") or {}
    record: dict[str, Any] = {
        "record": RECORD_TYPE, "time": iso_now(), "decision_id": decision.decision_id,
        "policy_revision": decision.policy_revision, "path": decision_path,
        "action": document.get("action"), "tool": tool.get("name"), "tool_version": tool.get("version"),
        "tenant": subject.get("tenant"), "subject": subject.get("id"),
        "request_id": (document.get("request") or {}).get("request_id"),
        "decision": {"result": decision.result, "allow": decision.allow,
                     "require_approval": decision.require_approval, "reasons": list(decision.reasons),
                     "risk": decision.risk},
        "masked_paths": [list(p) for p in masked_paths],
        "input": masked_input,
    }
    record = {k: v for k, v in record.items() if v is not None}
    if len(serialize(record).encode()) > max_bytes:
        del record["input"]
        record["input_omitted"] = "too_large"
    return record


def serialize(record: Mapping[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


class DecisionStreamSink:
    """XADD to one Redis Stream; trimmed by length on every add and by age (MINID) at most once a minute."""

    name = "redis"

    def __init__(self, redis: Client, key: str, maxlen: int, retention_s: int) -> None:
        self._redis = redis
        self.key = key
        self._maxlen = maxlen
        self._retention_ms = retention_s * 1000
        self._trimmed_at = 0.0

    async def write(self, line: str) -> None:
        await redis_call(self._redis.xadd(self.key, {"record": line}, maxlen=self._maxlen, approximate=True))
        now = time.time()
        if now - self._trimmed_at >= 60:
            self._trimmed_at = now
            await redis_call(self._redis.xtrim(self.key, minid=f"{int(now * 1000) - self._retention_ms}-0",
                                               approximate=True))


class DecisionRecorder:
    """Writes decision records; counts and logs a failed write, never raises it."""

    def __init__(self, config: DecisionsConfig, sinks: Sequence[Any], metrics: Metrics, decision_path: str, *,
                 fingerprint_key: bytes | None = None) -> None:
        self._config = config
        self._fingerprint_key = fingerprint_key or record_view.ephemeral_key()  # the audit records' key
        self._sinks = tuple(sinks)
        self._metrics = metrics
        self._path = decision_path
        self._timeout_s = config.timeout_ms / 1000.0

    async def record(self, document: Mapping[str, Any], decision: Decision,
                     view: RecordView = EACH_VALUE_HIDDEN) -> None:
        line = serialize(build_record(document, decision, decision_path=self._path, view=view,
                                      key=self._fingerprint_key, max_bytes=self._config.max_record_bytes))
        for sink in self._sinks:  # a lost decision record is counted, never blocks the call
            with logged_on_fault(log, "decision record sink %s failed", sink.name, faults=SINK_FAULTS,
                                 count=lambda: self._metrics.decision_record_failures.labels(sink.name).inc()):
                async with asyncio.timeout(self._timeout_s):
                    await sink.write(line)


def check_config(config: DecisionsConfig) -> None:
    unknown = sorted(set(config.sinks) - SINKS)
    if unknown:
        raise ConfigError(f"decisions.sinks: unknown sink(s) {', '.join(unknown)} (redis, stdout)")
    if config.enabled and not config.sinks:
        raise ConfigError("decisions.sinks: at least one sink is required when decisions.enabled is true")
    if config.max_record_bytes < 1024:
        raise ConfigError("decisions.max_record_bytes: must be at least 1024")


def build_recorder(config: DecisionsConfig, redis: Client, stream_key: str, metrics: Metrics,
                   decision_path: str, *, fingerprint_key: bytes | None = None) -> DecisionRecorder | None:
    check_config(config)
    if not config.enabled:
        return None
    sinks = [DecisionStreamSink(redis, stream_key, config.stream_maxlen, config.retention_s)
             if name == "redis" else StdoutSink() for name in config.sinks]
    return DecisionRecorder(config, sinks, metrics, decision_path, fingerprint_key=fingerprint_key)
