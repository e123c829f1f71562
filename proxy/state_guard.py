"""The state guard between the decision and the write (``expectedState``:
authorization and write in one transaction or under a version condition).

Owns: how a call carries the state it expects — the contract's ``state_guard.argument`` (a required
argument, so it is part of ``args_hash``, the operation key, the approval binding and OPA's input), which
a caller may also send as an ``If-Match`` header: the proxy copies the header's entity tag into that
argument before decoding (both given: they must agree) — and the ``If-Match`` value forwarded to the
backend, which applies the write only if the state still holds: the argument, or for a guard without one
the state its read captured when the call was decided (``entity_tag``; the pipeline runs the reads).

Must never: evaluate the condition itself (only the backend knows the current state), let a header that
names a state reach a tool whose contract declares no guard (refused: silently dropping a precondition
would run an unguarded write), or forward a value that could break a header line.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from .decode import strict_loads
from .errors import ProxyError
from .registry import ToolContract

_TAG_TEXT = re.compile(r"^[\x21\x23-\x5b\x5d-\x7e]{1,256}$")  # visible ASCII without " and \
_STRONG_TAG = re.compile(r'^"([\x21\x23-\x5b\x5d-\x7e]{1,256})"$')


def parse_if_match(value: str | None) -> str | None:
    """One strong entity tag (``"v7"``) from an ``If-Match`` header, its text; None when absent.
    A list, ``*`` or a weak tag (``W/"v7"``) is ``invalid_request``: a write's guard names one state."""
    if value is None:
        return None
    found = _STRONG_TAG.match(value.strip())
    if found is None:
        raise ProxyError("invalid_request", "If-Match must be one strong entity tag, such as \"v7\".",
                         details={"header": "If-Match"}, phase="request")
    return found.group(1)


def carry_if_match(tool: ToolContract, arguments: Any, expected: str | None, *, max_depth: int) -> Any:
    """The call's arguments with the ``If-Match`` state in the contract's guard argument (unchanged when
    the caller sent none)."""
    if expected is None:
        return arguments
    if tool.state_guard is None:
        raise ProxyError("invalid_request", "This tool declares no state guard: If-Match cannot be honoured, "
                         "so the call was not run.", details={"header": "If-Match", "tool": tool.name},
                         phase="request")
    if isinstance(arguments, str):
        arguments = strict_loads(arguments.encode(), what="arguments", phase="decode", max_depth=max_depth)
    if not isinstance(arguments, dict):
        return arguments  # the decode stage refuses it
    given = arguments.get(tool.state_guard)
    if given is not None and given != expected:
        raise ProxyError("invalid_arguments", f"If-Match and {tool.state_guard} name different states.",
                         details={"field": tool.state_guard, "header": "If-Match"}, phase="decode")
    return {**arguments, tool.state_guard: expected}


def if_match_tag(tool: ToolContract, arguments: Mapping[str, Any]) -> str | None:
    """The contract's guard argument as an ``If-Match`` entity tag (``"v7"``) for the backend, or None when
    the contract declares none or the value cannot travel in a header (it still travels in the body)."""
    name = tool.state_guard
    if name is None:
        return None
    return entity_tag(arguments.get(name))


def entity_tag(value: Any) -> str | None:
    """A state value as a strong entity tag (``"v7"``), or None when it cannot travel in a header."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    text = str(value)
    return f'"{text}"' if _TAG_TEXT.match(text) else None
