"""Tool listings: which tools a caller is shown (MCP ``tools/list``, ``GET /v1/tools``), and the
"did you mean" hint of an unknown tool's name, drawn from that same listing.

Owns: the one question "which of the registry's tools may this caller see?",
asked once per listing so it can be answered by one policy query (the OPA
``list`` action). Every protocol front that lists tools calls
``visible_tools`` and nothing else; the pipeline's ``tool_not_found`` asks
``suggest_tool``, which suggests only a name that listing would show. Must
never: decide whether a *call* is allowed (that is the authorize stage, per
call), read identity from anything but the authenticated ``Caller``, or let
the hint fail or stall the error it decorates.
"""

from __future__ import annotations

import logging
import uuid

from ..deadline import NO_DEADLINE, Deadline
from ..drift import OPEN, Quarantine
from ..identity import Caller
from .client import PolicyClient, RequestFacts, build_input
from ..registry import Registry, ToolContract

log = logging.getLogger(__name__)

# The hint's own listing decision gets at most this long: a slow OPA costs the refused call no more.
SUGGESTION_BUDGET_S = 0.5


async def visible_tools(registry: Registry, policy: PolicyClient, caller: Caller, *, request_id: str | None = None,
                        trace_id: str | None = None, deadline: Deadline = NO_DEADLINE,
                        quarantine: Quarantine = OPEN) -> list[ToolContract]:
    """The newest active version of each tool this caller may call, sorted by name.

    One OPA query (``input.action == "list"``) for the whole listing; OPA
    unavailable raises ``ProxyError("policy_unavailable")`` — a listing fails
    closed like a call. A listed tool is still authorized per call. A pinned MCP
    tool the ``quarantine`` refuses (drifted, or not yet verified) is not listed.
    """
    tools = [tool for tool in registry.active() if not quarantine.hides(tool)]
    document = build_input("list", caller, RequestFacts(request_id=request_id or uuid.uuid4().hex,
                                                        trace_id=trace_id),
                           catalog_digest=policy.catalog_digest, tools=tools)
    decision = await policy.decide(document, deadline=deadline)
    visible = set(decision.visible_tools) if decision.allow else set()
    return [tool for tool in tools if tool.name in visible]


async def suggest_tool(name: str, registry: Registry, policy: PolicyClient, caller: Caller, *,
                       request_id: str | None = None, trace_id: str | None = None, deadline: Deadline = NO_DEADLINE,
                       quarantine: Quarantine = OPEN) -> str | None:
    """The closest name this caller's listing shows to a misspelled ``name``, or None.

    Only listed names are candidates, so the hint never reveals a tool the
    listing rules hide from this caller. Any failure of the listing decision
    (OPA down, slow, refusing) gives no hint rather than a different error.
    """
    hint = deadline.within(SUGGESTION_BUDGET_S)
    if hint.expired:
        return None
    try:
        async with hint.timeout():
            tools = await visible_tools(registry, policy, caller, request_id=request_id, trace_id=trace_id,
                                        deadline=hint, quarantine=quarantine)
    except Exception:  # policy: fail quiet: the caller still gets its tool_not_found, without a hint
        log.debug("no tool suggestion: the listing decision failed", exc_info=True)
        return None
    import difflib  # only on this error path: a normal start does not load it

    matches = difflib.get_close_matches(name, [tool.name for tool in tools], n=1, cutoff=0.6)
    return matches[0] if matches else None
