"""Resolve stage, over time: which contract version a call gets, and what it is told about it.

Owns: the run pin (a run keeps the contract version it started
with) and the deprecation facts of a contract (RFC 9745 ``Deprecation``,
RFC 8594 ``Sunset``, the envelope's ``deprecation`` block).

The pin: a call carrying ``X-Run-Id`` resolves its version, then
``SET <prefix>:runpin:{<tenant>}:<run digest>:<tool> <version> NX GET EX <ttl>``
— one round trip that both records the first version of the run and returns
the version recorded earlier. A call without an explicit version gets the
pinned version (even when the registry's default moved on); a call with an
explicit version gets that version. A pinned version that has been retired is
not silently swapped for the new default (a run whose contract
was stopped re-plans): the call is ``tool_not_found`` (reason ``retired``,
``replaced_by``); a call naming a callable version then re-pins the run to it
(a second round trip, only in that case). Calls without ``X-Run-Id`` touch
nothing here.

Must never: pin a version the registry does not hold, move a pin to a version
the caller did not ask for, or let a run's pin be read by another tenant or
subject (the key is scoped by both).
"""

from __future__ import annotations

import hashlib
import logging
from datetime import date, datetime, timezone
from email.utils import format_datetime
from typing import TYPE_CHECKING, Any

from . import store
from .errors import ProxyError
from .identity import Caller
from .registry import Registry, ToolContract, retired_error

if TYPE_CHECKING:  # pragma: no cover
    from .requests import ToolCallRequest

log = logging.getLogger("toolproxy.versions")


class VersionResolver:
    def __init__(self, *, redis: Any, prefix: str, pin_ttl_s: int, read_policy: str) -> None:
        self._redis = redis
        self._prefix = prefix
        self._ttl_s = pin_ttl_s
        self._read_policy = read_policy

    def pin_key(self, caller: Caller, run_id: str, tool: str) -> str:
        run = hashlib.sha256(f"{caller.subject}\x00{run_id}".encode()).hexdigest()[:32]
        return store.key(self._prefix, "runpin", caller.tenant, run, tool)

    async def resolve(self, registry: Registry, request: "ToolCallRequest", caller: Caller) -> ToolContract:
        wanted = registry.resolve(request.tool, request.version)  # unknown or retired: refused before Redis
        run_id = request.meta.run_id
        if run_id is None:
            return wanted
        # The store away: per read_policy, an explicit version or a read proceeds unpinned (_pin_unavailable)
        return await store.degrade_on_fault(
            self._pinned(registry, request, self.pin_key(caller, run_id, wanted.name), wanted),
            lambda _: self._pin_unavailable(wanted, explicit=request.version is not None))

    async def _pinned(self, registry: Registry, request: "ToolCallRequest", key: str,
                      wanted: ToolContract) -> ToolContract:
        """The contract of the run's pin ``key``, pinned to ``wanted`` by the run's first call of the tool."""
        pinned = await store.redis_call(self._redis.set(key, wanted.version, nx=True, get=True, ex=self._ttl_s))
        if pinned is None:
            return wanted  # the run's first call of this tool: pinned to what it resolved
        pinned_version = pinned.decode() if isinstance(pinned, bytes) else str(pinned)
        if request.version is not None:
            if pinned_version != wanted.version:
                await self._repin_if_retired(registry, key, wanted, pinned_version)
            return wanted
        contract = registry.get(wanted.name, pinned_version)
        if contract is None:  # the version left the registry altogether: as retired, without a successor
            raise ProxyError("tool_not_found", "The version this run started with is no longer in the registry; "
                             "re-plan with an explicit version.",
                             details={"tool": wanted.name, "version": pinned_version, "reason": "retired",
                                      "replaced_by": None}, phase="resolve")
        if not contract.callable:
            raise retired_error(contract)
        return contract

    async def _repin_if_retired(self, registry: Registry, key: str, wanted: ToolContract, pinned: str) -> None:
        old = registry.get(wanted.name, pinned)
        if old is not None and old.callable:
            return  # an explicit version for one call; the run keeps its pin
        # the run keeps its old pin until the TTL
        with store.logged_on_fault(log, "could not re-pin a run of %s to %s", wanted.name, wanted.version):
            await store.redis_call(self._redis.set(key, wanted.version, xx=True, keepttl=True))

    def _pin_unavailable(self, wanted: ToolContract, *, explicit: bool) -> ToolContract:
        """Redis is away: an explicit version or a read (read_policy proceed) goes on; else nothing is sent."""
        if explicit or (not wanted.is_write and self._read_policy == "proceed"):
            log.warning("run pin store unreachable: %s resolves to %s without its pin", wanted.name, wanted.version)
            return wanted
        raise store.unavailable("The state store is unreachable; the run's contract version cannot be read, "
                                "nothing was sent.", phase="resolve")


def deprecation(tool: ToolContract | None) -> dict[str, Any] | None:
    """The envelope's ``deprecation`` block (and the MCP ``_meta`` entry), None for an active contract."""
    if tool is None or tool.status != "deprecated":
        return None
    return {"deprecated_at": tool.deprecated_at, "sunset": tool.sunset, "replaced_by": tool.replaced_by}


def deprecation_headers(tool: ToolContract | None) -> dict[str, str]:
    """``Deprecation: @<unix seconds>`` (RFC 9745) and ``Sunset: <HTTP-date>`` (RFC 8594)."""
    facts = deprecation(tool)
    if facts is None:
        return {}
    headers = {}
    if facts["deprecated_at"]:
        headers["Deprecation"] = f"@{int(_midnight(facts['deprecated_at']).timestamp())}"
    if facts["sunset"]:
        headers["Sunset"] = format_datetime(_midnight(facts["sunset"]), usegmt=True)
    return headers


def _midnight(day: str) -> datetime:
    return datetime.combine(date.fromisoformat(day), datetime.min.time(), tzinfo=timezone.utc)
