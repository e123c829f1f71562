"""HTTP JSON backend adapter.

Owns: POSTing canonical arguments to a tool's HTTP backend over the hot path's
wire (``proxy.wire.http``) within the call's budget, forwarding trusted
headers and the call's signed ``Txn-Token``, attaching the backend's credential (``backend.auth``: its
headers and TLS context, asked of ``proxy.credentials`` per request, after the decision), asking a contract's
``cancel_endpoint`` to stop a sent call (through the shared ``aiohttp.ClientSession``: a rare request), and
classifying every failure honestly:
whether the request left the proxy and whether the effect is known to have
happened. Must never: retry (the wire sends a read once more only when a reused
connection closed before answering; a write never), claim "not applied" for a write without proof,
or pass backend bodies, hostnames or exception text to the caller.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import time
from typing import Any, Awaitable, Mapping

import aiohttp

from ..decode import strict_loads
from ..envelope import iso
from ..state_guard import if_match_tag
from ..errors import ProxyError
from ..telemetry import spans
from ..wire.http import Answer, HttpWire, Progress, SlowAnswer, TooLarge
from ..identity import Caller
from ..registry import ToolContract
from ..credentials import Credentials, Headers, OnBehalfOf
from . import (BackendCall, BackendResult, deadline_passed, failed_answer, partial_answer, safe_error_fields,
               safe_value, unanswered)
from .call_tokens import CallTokens


class HttpAdapter:
    def __init__(self, wire: HttpWire, session: aiohttp.ClientSession, services: Mapping[str, str], *,
                 tokens: CallTokens, max_response_bytes: int, max_json_depth: int,
                 credentials: Credentials | None = None) -> None:
        self._wire = wire
        self._credentials = credentials or Credentials()
        self._tokens = tokens
        self._session = session
        self._services = dict(services)
        self._max_response_bytes = max_response_bytes
        self._max_json_depth = max_json_depth

    async def call(self, call: BackendCall) -> BackendResult:
        tool = call.tool
        url = tool.backend.resolve(self._services)
        if url is None:
            raise ProxyError("dependency_unavailable", "The tool's backend is not configured.",
                             details={"tool": tool.name}, phase="execute")
        if call.deadline.expired:
            raise ProxyError("timeout_not_started", "No time budget was left to start the call.",
                             phase="execute", attempted=False, committed=False)
        progress = Progress()
        started = time.monotonic()
        try:
            async with call.deadline.timeout():
                # A read may go once more on a fresh connection when a reused one closed before answering
                # (the wire never re-sends a write whose bytes may have reached the backend).
                headers = forwarded_headers(call, self._tokens.for_call(call))
                auth = tool.backend.auth
                if auth is not None:  # the credential's headers replace any of the same name
                    headers.update(await self._credential(tool, auth, call.subject, call.tenant, call.caller_token,
                                                          call.deadline.budget()))
                answer = await self._wire.post(url, call.canonical_arguments, headers.items(),
                                               progress=progress, max_body=self._max_response_bytes,
                                               retry_stale=not tool.is_write, tls=self._credentials.tls(auth))
        except TimeoutError:  # the budget, or the connect timeout (then nothing was sent)
            raise self._timed_out(call, progress, time.monotonic() - started) from None
        except TooLarge as exc:
            details: dict[str, Any] = {"limit_bytes": exc.limit} if exc.what != "headers" \
                else {"limit_headers": exc.limit}
            if exc.what != "body":
                details["part"] = exc.what
            raise ProxyError("output_invalid", "The tool returned more data than allowed.",
                             details=details, phase="verify", attempted=True,
                             committed=_committed_by_status(exc.status, call.tool.is_write)) from None
        except OSError as exc:  # WireError included
            if not progress.connected:
                raise ProxyError("dependency_unavailable", "The tool's backend could not be reached.",
                                 details={"tool": tool.name}, phase="execute",
                                 attempted=False, committed=False) from None
            raise self._connection_lost(call, progress,
                                        "answer_too_slow" if isinstance(exc, SlowAnswer) else "connection_lost") from None
        return self._classify(call, answer)

    def _partial(self, call: BackendCall, answer: Answer, backend_request_id: str | None) -> BackendResult:
        """207: the backend applied some items of the call and not (yet) the others."""
        try:
            partial = partial_answer(strict_loads(answer.body, what="backend output", phase="verify",
                                                  max_depth=self._max_json_depth))
        except ProxyError:
            partial = None
        if partial is None:  # it says "partly applied" without saying what: the effect is unknown
            raise ProxyError("output_invalid", "The tool reported a partial result in a form that cannot be read.",
                             details={"tool": call.tool.name}, phase="verify", attempted=True,
                             committed=None if call.tool.is_write else False)
        return BackendResult(data=None, status=answer.status, backend_request_id=backend_request_id,
                             server_time=server_time(answer.headers.get("date")), partial=partial)

    async def cancel(self, tool: ToolContract, key: str, caller: Caller, timeout_s: float) -> str:
        """Ask the backend to stop a sent call (its contract's ``cancel_endpoint``): ``accepted`` (2xx),
        ``refused`` (any other answer), ``unreachable``. An accepted request is no proof of anything: the
        caller still waits for the call's own answer or asks the status endpoint."""
        url = tool.cancel_endpoint.for_key(self._services, key) if tool.cancel_endpoint else None
        if url is None:
            return "not_configured"
        assert tool.cancel_endpoint is not None
        token = self._tokens.for_operation(tool, tool.cancel_endpoint, scope="tool:cancel", key=key,
                                           tenant=caller.tenant, subject=caller.subject, agent=caller.agent,
                                           version=tool.version, budget_s=timeout_s)
        headers = {"Idempotency-Key": key, "X-Toolproxy-Tenant": caller.tenant,
                   "X-Toolproxy-Tool-Version": tool.version, "Txn-Token": token, **spans.outgoing()}
        auth = tool.backend.auth
        try:
            async with asyncio.timeout(timeout_s):
                if auth is not None:
                    headers.update(await self._credential(tool, auth, caller.subject, caller.tenant, caller.token,
                                                          timeout_s))
                async with self._session.post(url, headers=headers, allow_redirects=False,
                                              ssl=self._credentials.tls(auth) or True) as response:
                    status = response.status
        except (TimeoutError, aiohttp.ClientError, OSError, ProxyError):  # ProxyError: no credential
            return "unreachable"
        return "accepted" if 200 <= status < 300 else "refused"

    def _credential(self, tool: ToolContract, auth: str, subject: str, tenant: str, token: str,
                    wait_s: float) -> Awaitable[Headers]:
        """The headers credential ``auth`` adds to a request for ``tool`` (the audience is its backend service)."""
        return self._credentials.attach(auth, audience=tool.backend_name, caller=OnBehalfOf(subject, tenant, token),
                                        wait_s=wait_s)

    def _timed_out(self, call: BackendCall, progress: Progress, elapsed: float) -> ProxyError:
        return deadline_passed(call, sent=progress.sent or progress.connected, elapsed_s=elapsed, backend="backend")

    def _connection_lost(self, call: BackendCall, progress: Progress, reason: str) -> ProxyError:
        return unanswered(call, sent=progress.sent, why="connection_lost", details={"reason": reason})

    def _classify(self, call: BackendCall, answer: Answer) -> BackendResult:
        status, body = answer.status, answer.body
        backend_request_id = _safe(answer.headers.get("x-request-id") or answer.headers.get("x-backend-request-id"))
        if status == PARTIAL_STATUS:
            return self._partial(call, answer, backend_request_id)
        if 200 <= status < 300:
            try:
                data = strict_loads(body, what="backend output", phase="verify", max_depth=self._max_json_depth)
            except ProxyError:
                raise ProxyError("output_invalid", "The tool returned data that is not valid JSON.",
                                 details={"tool": call.tool.name}, phase="verify",
                                 attempted=True, committed=_committed_by_status(status, call.tool.is_write)) from None
            return BackendResult(data=data, status=status, backend_request_id=backend_request_id,
                                 server_time=server_time(answer.headers.get("date")))
        error = _backend_error(body, self._max_json_depth)
        details: dict[str, Any] = {"tool": call.tool.name, "backend_status": status}
        if error.get("code"):
            details["backend_code"] = error["code"]
        if error.get("field"):
            details["field"] = error["field"]
        if backend_request_id:
            details["backend_request_id"] = backend_request_id
        if status in (429, 503):  # the backend says when to come back: the quota stage pauses it that long
            retry_after = _retry_after(answer.headers.get("retry-after"))
            if retry_after is not None:
                details["retry_after_s"] = retry_after
        if status == 429:
            return _raise(ProxyError("rate_limited", "The backend is rate limiting this tool.",
                                     details=details, phase="execute", attempted=True, committed=False))
        if status in (401, 403):
            return _raise(ProxyError("forbidden", "The backend refused this call.", details=details,
                                     phase="execute", attempted=True, committed=False))
        if 400 <= status < 500:
            reason = f": {error['code']}" if error.get("code") else ""
            return _raise(ProxyError("business_rejected", f"The backend rejected the request{reason}.",
                                     details=details, phase="execute", attempted=True, committed=False))
        if error.get("applied") is False:
            return _raise(ProxyError("dependency_unavailable",
                                     "The backend failed and reported that nothing was applied.",
                                     details=details, phase="execute", attempted=True, committed=False))
        return _raise(failed_answer(call, details=details))


PARTIAL_STATUS = 207  # Multi-Status: the body is {"state": "partial", "committed": [...], "pending": [...]}


def _raise(error: ProxyError) -> BackendResult:
    raise error


def forwarded_headers(call: BackendCall, token: str) -> dict[str, str]:
    """The trusted headers every backend request carries (the MCP adapter forwards them too), with the
    call's signed ``Txn-Token`` (the ``X-Toolproxy-*`` headers are the same facts, unsigned)."""
    headers = {
        "Txn-Token": token,
        "Content-Type": "application/json",
        "Accept": "application/json",
        "X-Call-Id": call.call_id,
        "X-Request-Id": call.request_id,
        "X-Request-Timeout-Ms": str(max(1, int(call.deadline.budget() * 1000))),
        "traceparent": call.traceparent,
        "X-Toolproxy-Subject": call.subject,
        "X-Toolproxy-Tenant": call.tenant,
        "X-Toolproxy-Agent": call.agent,
        "X-Toolproxy-Tool-Version": call.tool.version,
    }
    if call.tracestate:
        headers["tracestate"] = call.tracestate
    if call.idempotency_key is not None:
        headers["Idempotency-Key"] = call.idempotency_key
    if call.fencing_token is not None:
        headers["X-Fencing-Token"] = str(call.fencing_token)
    expected = if_match_tag(call.tool, call.arguments) or call.captured_if_match
    if expected is not None:
        headers["If-Match"] = expected
    return headers


def server_time(value: str | None) -> str | None:
    """The backend's ``Date`` header as an ISO timestamp (its own clock at the answer), None if absent."""
    if not value:
        return None
    return _parsed_date(value)


# A Date header changes once a second: parsing it (``email.utils``) was about 1.5% of a read's CPU.
@functools.lru_cache(maxsize=8)
def _parsed_date(value: str) -> str | None:
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return iso(when.timestamp())


def _committed_by_status(status: int, is_write: bool) -> bool | None:
    if not is_write:
        return False
    return True if 200 <= status < 300 else None


def _backend_error(body: bytes, max_depth: int) -> dict[str, Any]:
    try:
        return safe_error_fields(strict_loads(body, what="backend error", max_depth=max_depth))
    except ProxyError:
        return {}


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _safe(value: str | None) -> str | None:
    return safe_value(value)
