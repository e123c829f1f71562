"""Tool listings: which tools a caller is shown (MCP ``tools/list``).

Owns: the one question "which of the registry's tools may this caller see?",
asked once per listing so it can be answered by one policy query (the OPA
``list`` action). Every protocol front that lists tools calls
``visible_tools`` and nothing else. Must never: decide whether a *call* is
allowed (that is the authorize stage, per call), or read identity from
anything but the authenticated ``Caller``.
"""

from __future__ import annotations

import uuid

from ..drift import OPEN, Quarantine
from ..identity import Caller
from ..policy.client import PolicyClient, RequestFacts, build_input
from ..registry import Registry, ToolContract


async def visible_tools(registry: Registry, policy: PolicyClient, caller: Caller, *, request_id: str | None = None,
                        trace_id: str | None = None, budget_s: float | None = None,
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
    decision = await policy.decide(document, budget_s=budget_s)
    visible = set(decision.visible_tools) if decision.allow else set()
    return [tool for tool in tools if tool.name in visible]
