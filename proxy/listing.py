"""Tool listings: which tools a caller is shown (MCP ``tools/list``).

Owns: the one question "which of the registry's tools may this caller see?",
asked once per listing so it can be answered by one policy query (the OPA
``list`` action). Every protocol front that lists tools calls
``visible_tools`` and nothing else. Must never: decide whether a *call* is
allowed (that is the authorize stage, per call), or read identity from
anything but the authenticated ``Caller``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .identity import Caller
from .registry import ToolContract

if TYPE_CHECKING:  # pragma: no cover
    from .app import Runtime


async def visible_tools(runtime: "Runtime", caller: Caller) -> list[ToolContract]:
    """The newest active version of each tool this caller may call, sorted by name.

    INTERIM until the authorization stage (issue 3) is on main: every active
    tool is listed. That issue replaces this body with its OPA ``list``
    query; a call to a tool that is listed here but not permitted is still
    refused by the authorize stage, so the listing can only over-show, never
    over-grant.
    """
    return runtime.registry.active()
