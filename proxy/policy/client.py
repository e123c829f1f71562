"""Policy decisions: the OPA input document, the query, and the decision.

Owns: building the OPA input (``schemas/opa-input.schema.json``) in exactly
one place (``build_input``), one POST per decision to OPA's Data API over the decision wire (``http_wire``, keep-alive, on OPA's
Unix socket or TCP address as ``opa.url`` says) with its own short timeout, validating the
decision document (``schemas/opa-decision.schema.json``, checked by ``decision_ok``
without a schema engine per call), the tool catalog
pushed into OPA (``data.toolproxy.catalog``, through ``opa_control``) and its
digest, handing each decision to the decision recorder (``decisions``) when
records are on, and the policy metrics. Must never: allow when OPA is unreachable, slow, erroring, answers
nothing or answers something malformed (fail closed), read an evaluation error of the policy (asked with
``strict-builtin-errors``) as anything but a deny, decide anything itself,
or put identity taken from tool arguments into the input.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import orjson

from ..config import OpaConfig
from ..deadline import NO_DEADLINE, Deadline
from .decisions import Decision, DecisionRecorder  # Decision: importable from here too
from ..errors import ProxyError
from ..wire.http import HttpWire, TooLarge
from ..identity import Caller
from ..telemetry.metrics import Metrics
from ..telemetry.record_view import EACH_VALUE_HIDDEN, RecordView
from ..normalize import NormalizedCall, canonical_json, sha256_hex
from .opa_control import ControlError, OpaControl, read_token
from ..registry import Registry, ToolContract

log = logging.getLogger("toolproxy.policy")

CATALOG_PATH = "toolproxy/catalog"
STRICT = "?strict-builtin-errors=true"
_JSON = (("Content-Type", "application/json"), ("Accept", "application/json"))


@dataclass(frozen=True)
class RequestFacts:
    """The transport facts a policy may see (no headers, no bodies)."""

    request_id: str
    call_id: str | None = None
    run_id: str | None = None
    trace_id: str | None = None
    flow_as: tuple[str, str] | None = None  # (agent, subject) whose flow labels input.flow holds (a related read)


def catalog_document(registry: Registry) -> dict[str, Any]:
    """What ``toolproxy opa-data`` prints and the proxy PUTs at ``data.toolproxy.catalog``."""
    tools: dict[str, dict[str, Any]] = {}
    for tool in registry.all():
        tools.setdefault(tool.name, {})[tool.version] = {**tool.summary(), "status": tool.status,
                                                         "flow": tool.flow_facts()}
    return {"digest": sha256_hex(canonical_json(tools)), "tools": tools}


def build_input(action: str, caller: Caller, request: RequestFacts, *, catalog_digest: str,
                tool: ToolContract | None = None, normalized: NormalizedCall | None = None,
                approval: Mapping[str, Any] | None = None,
                tools: Iterable[ToolContract] = (),
                original: Mapping[str, Any] | None = None,
                compensation: Mapping[str, Any] | None = None,
                flow: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The OPA input document; the only place it is built. ``compensate``: ``tool``/``arguments`` are the
    compensating call, ``original`` the operation it compensates (trusted facts from its record) and
    ``compensation`` the contract's declaration. ``cancel`` / ``read_operation``: ``original`` is the
    operation of another subject the caller wants to cancel or read. ``flow``: the call's flow labels
    (``proxy.flow.FlowState.policy_input``), when the flow stage read them for this call."""
    document: dict[str, Any] = {
        "action": action,
        "subject": {"id": caller.subject, "tenant": caller.tenant, "roles": list(caller.roles),
                    "scopes": list(caller.scopes), "source": caller.source},
        "agent": {"id": caller.agent},
        "catalog_digest": catalog_digest,
        "request": {"request_id": request.request_id, "call_id": request.call_id, "run_id": request.run_id,
                    "trace_id": request.trace_id},
    }
    if action in ("call", "compensate"):
        assert tool is not None and normalized is not None
        summary = tool.summary()
        document.update({
            "tool": {**{k: summary[k] for k in ("name", "version", "mode", "risk", "resources",
                                                "idempotency_required")}, "backend": tool.backend_name,
                     "flow": tool.flow_facts(),
                     **({"ownership_read": True} if tool.ownership_read is not None else {})},
            "arguments": dict(normalized.arguments),
            "args_hash": normalized.args_hash,
            "resources": [{"id": r.id, "kind": r.id.partition(":")[0], "access": r.access}
                          for r in normalized.resources],
            "approval": dict(approval) if approval is not None else None,
        })
        if flow is not None:
            document["flow"] = flow
        if action == "compensate":
            document["original"] = dict(original or {})
            document["compensation"] = dict(compensation or {})
    elif action in ("cancel", "read_operation"):
        document["original"] = dict(original or {})
    else:
        document["tools"] = [{"name": t.name, "version": t.version, "mode": t.mode, "risk": t.risk}
                             for t in tools]
    return document


class PolicyClient:
    """Asks OPA; keeps OPA's copy of the tool catalog current."""

    def __init__(self, config: OpaConfig, wire: HttpWire, metrics: Metrics,
                 registry: Registry, recorder: DecisionRecorder | None = None) -> None:
        self._config = config
        self._recorder = recorder
        # Control plane (catalog push) and decisions over the one wire that reaches OPA. Both carry the proxy's
        # bearer token: OPA answers nobody else (proxy/policy/opa_authz.rego).
        token = read_token(config.token_file)
        self._headers = _JSON + ((("Authorization", f"Bearer {token}"),) if token else ())
        self._control = OpaControl(config.http_base, wire, timeout_s=max(config.timeout_ms / 1000.0, 2.0),
                                   retries=2, token=token)
        self._metrics = metrics
        self._catalog = catalog_document(registry)
        self._wire = wire
        # strict-builtin-errors: a builtin that fails (to_number("x"), a bad regex) is an evaluation error
        # OPA reports, not an undefined expression that lets a deny rule silently not match.
        self._url = config.http_base + "/v1/data/" + config.decision_path.strip("/") + STRICT
        self._opa_at = config.url
        self._timeout_s = config.timeout_ms / 1000.0
        self._push_lock = asyncio.Lock()
        self._pushed_mono = 0.0

    def use_registry(self, registry: Registry) -> None:
        """A reloaded registry: its catalog is what OPA gets on the next push and what decisions compare."""
        self._catalog = catalog_document(registry)

    @property
    def catalog_digest(self) -> str:
        return self._catalog["digest"]

    async def push_catalog(self) -> bool:
        """PUT the catalog at data.toolproxy.catalog; False (logged) if OPA refused or is away."""
        try:
            await self._control.put_data(CATALOG_PATH, self._catalog)
            ok = True
        except ControlError:
            ok = False
        if ok:
            self._pushed_mono = time.monotonic()
            log.info("tool catalog loaded into OPA (digest %s)", self.catalog_digest[:12])
        else:
            log.warning("could not load the tool catalog into OPA at %s (opa.url); decisions fail closed "
                        "(policy_unavailable) until it answers: check the address and that OPA runs", self._opa_at)
        return ok

    async def decide(self, document: Mapping[str, Any], *, deadline: Deadline = NO_DEADLINE,
                     record_view: RecordView = EACH_VALUE_HIDDEN) -> Decision:
        """One decision within ``opa.timeout_ms`` and the call's ``deadline``; recorded when decision records
        are on, its arguments as ``record_view`` (the contract's) keeps them: every value fingerprinted
        without one."""
        started = time.monotonic()
        decision = await self._query(document, deadline)
        if not decision[1] and self._config.push_catalog:
            # OPA lost the catalog (restarted) or holds another one: load ours, ask once more.
            await self._reload_catalog(started)
            decision = await self._query(document, deadline)  # what is left of it now
            if not decision[1]:
                self._fail("catalog_missing")
        self._metrics.child(self._metrics.policy_decisions, decision[0].result).inc()
        if self._recorder is not None:
            await self._recorder.record(document, decision[0], record_view)
        return decision[0]

    async def _reload_catalog(self, asked_at: float) -> None:
        async with self._push_lock:
            if self._pushed_mono > asked_at:
                return  # another call reloaded it meanwhile
            await self.push_catalog()

    async def _query(self, document: Mapping[str, Any], deadline: Deadline) -> tuple[Decision, bool]:
        timeout = deadline.budget(self._timeout_s)
        if timeout <= 0:
            raise ProxyError("timeout_not_started", "No time budget was left to start the call.",
                             phase="authorize")
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                answer = await self._wire.post(self._url, orjson.dumps({"input": document}), self._headers,
                                               retry_stale=True)  # a query has no side effect
            status, body = answer.status, answer.body
        except TimeoutError:
            self._fail("timeout", started)
        except OSError:  # the wire's errors included
            self._fail("unreachable", started)
        except TooLarge:  # an answer past the wire's head or body limits: no decision in it
            self._fail("too_large", started)
        self._metrics.opa_duration.observe(time.monotonic() - started)
        if status != 200:
            erred = _eval_error(status, body)
            if erred:  # OPA is up and answered: its policy erred on this input
                self._metrics.child(self._metrics.dependency_up, "opa").set(1)
            self._fail(erred or "http_error")
        self._metrics.child(self._metrics.dependency_up, "opa").set(1)
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            self._fail("bad_decision")
        result = payload.get("result") if isinstance(payload, dict) else None
        if result is None:
            self._fail("undefined")
        if not decision_ok(result):
            self._fail("bad_decision")
        decision = Decision(
            allow=result["allow"], require_approval=result["require_approval"],
            reasons=tuple(result["reasons"]), risk=result.get("risk", "unknown"),
            policy_revision=result.get("policy_revision"), decision_id=payload.get("decision_id"),
            visible_tools=tuple(result.get("visible_tools", ())), quota_class=result.get("quota_class"))
        return decision, result.get("catalog_current", True)

    def _fail(self, reason: str, started: float | None = None) -> Any:
        """Fail closed. Unavailable, slow or undefined: retryable; a malformed decision: forbidden."""
        if started is not None:
            self._metrics.opa_duration.observe(time.monotonic() - started)
        self._metrics.opa_errors.labels(reason).inc()
        self._metrics.policy_decisions.labels("error").inc()
        if reason in {"timeout", "unreachable", "http_error"}:
            self._metrics.dependency_up.labels("opa").set(0)
        log.warning("policy decision failed closed: %s", reason)
        if reason == "eval_error":  # OPA is up; its policy errs on this input: a deny, never "no match"
            raise ProxyError("forbidden", "The call is not permitted.", details={"reason": "policy_error"},
                             phase="authorize")
        if reason == "bad_decision":
            raise ProxyError("forbidden", "The call is not permitted.", details={"reason": "policy_error"},
                             phase="authorize")
        raise ProxyError("policy_unavailable", "The policy service could not decide; nothing was done.",
                         details={"reason": reason}, phase="authorize")


def _eval_error(status: int, body: bytes) -> str | None:
    """"eval_error" when OPA answered that evaluating the policy failed (a conflict in a complete rule, a
    builtin error, a type error at run time: ``eval_*`` codes); logged by code and rule location only (the
    messages can quote arguments). None for any other failure."""
    try:
        payload = orjson.loads(body) if status == 500 else None
    except orjson.JSONDecodeError:
        return None
    errors = payload.get("errors") if isinstance(payload, dict) else None
    found = [e for e in errors if isinstance(e, dict) and str(e.get("code", "")).startswith("eval_")] \
        if isinstance(errors, list) else []
    if not found:
        return None
    for error in found[:3]:
        location = error.get("location") if isinstance(error.get("location"), dict) else {}
        log.warning("policy evaluation error %s at %s:%s: the call is denied", error.get("code"),
                    location.get("file", "?"), location.get("row", "?"))
    return "eval_error"


_STRING_LISTS = ("reasons", "visible_tools")
_OPTIONAL = (("risk", str), ("policy_revision", str), ("catalog_current", bool))


def decision_ok(result: Any) -> bool:
    """Exactly ``schemas/opa-decision.schema.json`` (tests/test_policy_decision.py holds the two together),
    as plain type checks: the schema engine cost more per call than the rest of the authorize stage."""
    if type(result) is not dict or type(result.get("allow")) is not bool \
            or type(result.get("require_approval")) is not bool or "reasons" not in result:
        return False
    if result["allow"] and result["require_approval"]:
        return False
    for name in _STRING_LISTS:
        value = result.get(name, ())
        if value != () and (type(value) is not list or any(type(item) is not str for item in value)):
            return False
    return all(name not in result or type(result[name]) is kind for name, kind in _OPTIONAL)

