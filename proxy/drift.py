"""Pinned upstream MCP tools: digests, the verdict of a check, and the quarantine the call path reads.

Owns: what a pin is — the SHA-256 of the RFC 8785 canonical JSON of an
upstream tool's definition (name, description, inputSchema, outputSchema,
annotations) and of the sorted names its upstream lists (the list digest
catches renames and additions a per-tool digest cannot see) —; comparing a
live tool list with the registry's pins (``compare``) and saying what changed
in a readable, bounded diff; and ``Quarantine``: the latest verdict per pinned
contract, swapped whole per upstream, which the resolve stage (``check``) and
every listing (``hides``) read.

A pinned contract is served when the latest check of its upstream matched
its pins; refused with ``contract_drift`` once a check did not — and it stays
refused when the upstream changes back: a drift is lifted only by a re-pin
(a reload with a new pin: a new key, checked afresh) or by an operator's
acknowledgement (``acknowledge``) once the upstream matches its pins again,
never by the upstream itself —; and, until a check
succeeded (start-up, an unreachable upstream, a new pin after a reload),
refused with ``dependency_unavailable`` (``mcp_pins.unverified: refuse``, the
default) or served (``serve``). A contract without a pin is not checked.

**Fresh before it is sent** (``fresh``): a pinned call is sent only when its
upstream's pins were verified by a check that started at most
``mcp_pins.max_age_ms`` ago (writes and external sinks) or
``mcp_pins.read_max_age_ms`` ago (other reads); else it waits (within its
budget) for a check it asks the watcher for. Past half the bound it asks for
one without waiting, so a steady stream of calls rarely waits. A hostile
upstream sends no ``list_changed``: without this, a changed tool would run
until the next timed check.

Must never: talk to an upstream (``proxy/adapters/mcp_pins.py`` does, through
the ``refresh`` callback it gives), let an upstream's definition reach what the
model sees (the registry's contract is the model's view, always), or cost a
call whose pins are fresh more than a few dictionary lookups.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Protocol, Sequence

import rfc8785

from .deadline import Deadline
from .errors import ProxyError
from .registry import McpPin, ToolContract, thaw

MAX_DIFF_LINES = 120   # a readable diff is bounded: the upstream writes what is diffed
MAX_DIFF_LINE = 300
KINDS = ("definition", "removed", "tool_list")
UNREPRESENTABLE = "sha256:unrepresentable"  # a definition RFC 8785 cannot carry: equal to no pin


@dataclass(frozen=True)
class UpstreamTool:
    """One tool as an upstream lists it (untrusted: only digested and diffed, never shown to the model)."""

    name: str
    description: str | None
    input_schema: dict[str, Any]
    output_schema: dict[str, Any] | None
    annotations: dict[str, Any]

    @classmethod
    def from_sdk(cls, tool: Any) -> "UpstreamTool":
        """From the ``mcp`` SDK's ``Tool`` (read by attribute: this module never imports the SDK)."""
        annotations = tool.annotations
        return cls(name=tool.name, description=tool.description, input_schema=dict(tool.input_schema),
                   output_schema=dict(tool.output_schema) if tool.output_schema is not None else None,
                   annotations=annotations.model_dump(by_alias=True, exclude_none=True)
                   if annotations is not None else {})

    def definition(self) -> dict[str, Any]:
        """What the digest covers, in the protocol's own field names."""
        return {"name": self.name, "description": self.description, "inputSchema": self.input_schema,
                "outputSchema": self.output_schema, "annotations": self.annotations}


def digest(value: Any) -> str:
    """``sha256:<hex>`` of the RFC 8785 canonical JSON of ``value`` (ValueError if it has no canonical form)."""
    try:
        return "sha256:" + hashlib.sha256(rfc8785.dumps(value)).hexdigest()
    except rfc8785.CanonicalizationError as exc:
        raise ValueError(f"no canonical JSON form: {type(exc).__name__}") from None


def definition_digest(tool: UpstreamTool) -> str:
    try:
        return digest(tool.definition())
    except ValueError:  # a number RFC 8785 cannot carry: never equal to a pin
        return UNREPRESENTABLE


def list_digest(tools: Iterable[UpstreamTool]) -> str:
    return digest(sorted(tool.name for tool in tools))


def pin_of(tool: UpstreamTool, listed: Sequence[UpstreamTool]) -> McpPin:
    return McpPin(definition=definition_digest(tool), tool_list=list_digest(listed))


@dataclass(frozen=True)
class Drift:
    """Why a pinned contract is quarantined: which pin the live upstream broke, and a readable diff."""

    kind: str            # definition | removed | tool_list
    upstream_tool: str
    diff: str
    since: float = field(default_factory=time.time, compare=False)
    matches_again: bool = field(default=False, compare=False)  # the latest check matched the pins again

    def summary(self) -> str:
        return {"definition": f"the upstream's definition of {self.upstream_tool!r} changed",
                "removed": f"the upstream no longer lists {self.upstream_tool!r}",
                "tool_list": "the upstream's tool list changed (a tool added, removed or renamed)"}[self.kind]


VERIFIED = None  # a verdict: the contract matched its pins


def compare(contracts: Iterable[ToolContract], listed: Sequence[UpstreamTool],
            baseline: Sequence[UpstreamTool] | None = None) -> list[tuple[ToolContract, Drift | None]]:
    """Each pinned contract of one upstream against that upstream's live list: None (it matches) or a Drift.

    ``baseline`` is the list as last seen matching (the diff's "before"); without one, the diff compares
    with what the registry holds (its reviewed view of the tool) and the names it imports.
    """
    by_name = {tool.name: tool for tool in listed}
    before = {tool.name: tool for tool in baseline or ()}
    live_list = list_digest(listed)
    verdicts: list[tuple[ToolContract, Drift | None]] = []
    for contract in contracts:
        pin, name = contract.backend.pin, contract.backend.tool or ""
        if pin is None:
            continue
        now = by_name.get(name)
        if now is None:
            verdicts.append((contract, Drift("removed", name, f"- {name} (no longer in the upstream's tools/list)")))
        elif definition_digest(now) != pin.definition:
            old = before.get(name)
            verdicts.append((contract, Drift("definition", name, definition_diff(
                old if old is not None and definition_digest(old) == pin.definition else None, now, contract))))
        elif live_list != pin.tool_list:
            old_names = sorted(before) if baseline is not None and list_digest(baseline) == pin.tool_list else None
            verdicts.append((contract, Drift("tool_list", name, list_diff(old_names, sorted(by_name)))))
        else:
            verdicts.append((contract, VERIFIED))
    return verdicts


def definition_diff(before: UpstreamTool | None, now: UpstreamTool, contract: ToolContract) -> str:
    """A unified diff of the tool's definition: the pinned one when known, else the registry's view of it."""
    if before is not None:
        old, label = before.definition(), "pinned (as last seen matching)"
    else:
        old = {"name": now.name, "description": contract.description, "inputSchema": thaw(contract.input_schema),
               "outputSchema": thaw(contract.output_schema) or None,
               "annotations": "(not kept by the registry)"}
        label = f"registry {contract.name} {contract.version} (the reviewed view; the pinned text is not kept)"
    if before is None:
        now_view = dict(now.definition())
        now_view["annotations"] = now.annotations or "(none)"
    else:
        now_view = now.definition()
    import difflib  # a drifted MCP upstream only: a JSON-only sidecar never diffs (tests/test_footprint_imports.py)

    return _bounded(difflib.unified_diff(_lines(old), _lines(now_view), label, "upstream now", lineterm="", n=2))


def list_diff(before: list[str] | None, now: list[str]) -> str:
    if before is None:
        return _bounded(["the pinned list is not kept; the upstream now lists:"] + [f"  {name}" for name in now])
    removed, added = sorted(set(before) - set(now)), sorted(set(now) - set(before))
    return _bounded([f"- {name}" for name in removed] + [f"+ {name}" for name in added])


def _lines(value: Mapping[str, Any]) -> list[str]:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str).split("\n")


def _bounded(lines: Iterable[str]) -> str:
    out = []
    for index, line in enumerate(lines):
        if index == MAX_DIFF_LINES:
            out.append(f"... (diff cut at {MAX_DIFF_LINES} lines)")
            break
        out.append(line if len(line) <= MAX_DIFF_LINE else line[:MAX_DIFF_LINE] + "...")
    return "\n".join(out)


_UNCHECKED = object()


class Checker(Protocol):
    """What checks upstreams (``proxy/adapters/mcp_pins.py``), as the freshness bound asks for it."""

    async def recheck(self, upstream: str) -> None:
        """Until a check of ``upstream`` that started after this call has ended (either way); at once when
        its checks are failing (they are retried on their backoff, never on demand)."""

    def nudge(self, upstream: str) -> None:
        """Check ``upstream`` soon (within ``mcp_pins.min_gap_ms``), without waiting for it."""


class Quarantine:
    """The latest verdict of every pinned contract, per upstream; read on every call of a pinned tool.

    Keys are (name, version, pin): a reloaded contract with a new pin is unverified until its upstream is
    checked again, and an old verdict never applies to it.
    """

    def __init__(self, *, serve_unverified: bool = False, max_age_s: float = 1.5,
                 read_max_age_s: float = 5.0) -> None:
        self._serve_unverified = serve_unverified
        self._max_age_s = max_age_s
        self._read_max_age_s = read_max_age_s
        self._by_upstream: dict[str, Mapping[tuple[str, str, McpPin], Drift | None]] = {}
        self._verdicts: Mapping[tuple[str, str, McpPin], Drift | None] = MappingProxyType({})
        self._upstream_of: Mapping[tuple[str, str, McpPin], str] = MappingProxyType({})
        self._checked_at: dict[str, float] = {}  # upstream -> monotonic start of its latest successful check
        self.checker: Checker | None = None  # set by the watcher; None: no freshness bound (tests, tools)

    @staticmethod
    def _key(tool: ToolContract) -> tuple[str, str, McpPin] | None:
        pin = tool.backend.pin
        return None if pin is None else (tool.name, tool.version, pin)

    def check(self, tool: ToolContract) -> None:
        """The resolve stage's question: raise unless the contract may be called now."""
        key = self._key(tool)
        if key is None:
            return
        verdict = self._verdicts.get(key, _UNCHECKED)
        if verdict is None or (verdict is _UNCHECKED and self._serve_unverified):
            return
        if verdict is _UNCHECKED:
            raise ProxyError("dependency_unavailable", "The tool's MCP server has not yet been checked against "
                             "the tool's pinned definition.", details={"tool": tool.name, "reason": "pins_unverified"},
                             phase="resolve", attempted=False, committed=False)
        assert isinstance(verdict, Drift)
        raise ProxyError("contract_drift", "The tool's MCP server changed the tool since it was reviewed; it is "
                         "quarantined until an operator re-pins or acknowledges it.",
                         details={"tool": tool.name, "version": tool.version, "drift": verdict.kind},
                         phase="resolve", attempted=False, committed=False)

    async def fresh(self, tool: ToolContract, deadline: Deadline) -> None:
        """Right before a pinned call is sent: its pins verified recently enough (module docstring), else
        wait for a check, until ``deadline`` (the call's own); then ``check`` again. Raises as ``check`` does, or
        ``dependency_unavailable`` (``pins_stale``) when no check ends within the budget. (A check that
        failed leaves the tool unverified, which ``check`` refuses unless ``mcp_pins.unverified: serve``.)"""
        key, checker = self._key(tool), self.checker
        if key is None or checker is None:
            return
        upstream = self._upstream_of.get(key)
        if upstream is None:  # never checked (or forgotten): the resolve stage's answer stands
            self.check(tool)
            return
        bound = self._max_age_s if tool.is_write or tool.flow_sink == "external" else self._read_max_age_s
        age = time.monotonic() - self._checked_at.get(upstream, float("-inf"))
        if age > bound:
            try:
                async with deadline.timeout():
                    await checker.recheck(upstream)
            except TimeoutError:
                raise ProxyError("dependency_unavailable", "The tool's MCP server could not be checked against "
                                 "the tool's pinned definition in time; nothing was sent.",
                                 details={"tool": tool.name, "reason": "pins_stale"}, phase="execute",
                                 attempted=False, committed=False) from None
        elif age > bound / 2:  # ahead of need: the next call finds a fresh check
            checker.nudge(upstream)
        self.check(tool)

    def hides(self, tool: ToolContract) -> bool:
        """Listings leave out what a call would be refused for (drifted, or unverified when refused)."""
        try:
            self.check(tool)
        except ProxyError:
            return True
        return False

    def record(self, upstream: str, verdicts: Iterable[tuple[ToolContract, Drift | None]], *,
               started: float | None = None) -> tuple[list[tuple[ToolContract, Drift]], list[ToolContract]]:
        """One upstream's new verdicts (replacing its old ones): (the contracts that newly drifted, the drifted
        ones whose upstream now matches their pins again). A drift is never lifted here: the upstream that
        changed a tool could otherwise change it back, and forth, at will (``acknowledge`` lifts it)."""
        old = self._by_upstream.get(upstream, {})
        new: dict[tuple[str, str, McpPin], Drift | None] = {}
        fresh: list[tuple[ToolContract, Drift]] = []
        returned: list[ToolContract] = []
        for contract, verdict in verdicts:
            key = self._key(contract)
            if key is None:
                continue
            previous = old.get(key, _UNCHECKED)
            if isinstance(previous, Drift) and verdict is None:
                if not previous.matches_again:
                    returned.append(contract)
                verdict = replace(previous, matches_again=True)  # still quarantined
            elif isinstance(verdict, Drift) and isinstance(previous, Drift) and previous == verdict:
                verdict = replace(previous, matches_again=False)  # the same drift: keep when it was first seen
            elif isinstance(verdict, Drift):
                fresh.append((contract, verdict))
            new[key] = verdict
        self._by_upstream[upstream] = MappingProxyType(new)
        self._checked_at[upstream] = time.monotonic() if started is None else started
        self._publish()
        return fresh, returned

    def acknowledge(self, name: str, version: str | None = None) -> list[tuple[str, str]]:
        """An operator lifts the quarantine of tool ``name`` (every version, or ``version``): only where the
        latest check found the upstream matching the pins again; a drift that is still live needs a re-pin.
        The (name, version) pairs lifted; ``ProxyError`` when nothing could be."""
        lifted: list[tuple[str, str]] = []
        live: list[str] = []
        for upstream, verdicts in list(self._by_upstream.items()):
            kept = dict(verdicts)
            for key, verdict in verdicts.items():
                if key[0] != name or (version is not None and key[1] != version) or not isinstance(verdict, Drift):
                    continue
                if verdict.matches_again:
                    kept[key] = VERIFIED
                    lifted.append((key[0], key[1]))
                else:
                    live.append(key[1])
            self._by_upstream[upstream] = MappingProxyType(kept)
        self._publish()
        if not lifted:
            raise ProxyError("operation_not_open", "Nothing to acknowledge: the tool is not quarantined, or its "
                             "upstream still differs from its pins (review the change, then re-pin it with "
                             "`toolproxy mcp repin`).", details={"tool": name, "still_drifted": sorted(live)},
                             phase="request")
        return lifted

    def unverified(self, upstream: str) -> None:
        """A check of ``upstream`` failed: its verified contracts are unverified until one succeeds, its drifted
        ones stay quarantined (an upstream cannot lift a quarantine by refusing to be checked)."""
        old = self._by_upstream.get(upstream, {})
        kept = {key: verdict for key, verdict in old.items() if verdict is not None}
        self._by_upstream[upstream] = MappingProxyType(kept)
        self._publish()

    def retain(self, upstreams: Iterable[str]) -> None:
        """Forget upstreams the registry no longer pins."""
        keep = set(upstreams)
        for url in [url for url in self._by_upstream if url not in keep]:
            del self._by_upstream[url]
            self._checked_at.pop(url, None)
        self._publish()

    def _publish(self) -> None:
        merged: dict[tuple[str, str, McpPin], Drift | None] = {}
        upstream_of: dict[tuple[str, str, McpPin], str] = {}
        for upstream, verdicts in self._by_upstream.items():
            merged.update(verdicts)
            upstream_of.update(dict.fromkeys(verdicts, upstream))
        self._verdicts = MappingProxyType(merged)  # one reference swap: a call sees the old or the new set
        self._upstream_of = MappingProxyType(upstream_of)

    def view(self, tools: Iterable[ToolContract]) -> list[dict[str, Any]]:
        """Every pinned contract of ``tools`` with its state, for the admin API and the console."""
        rows = []
        for tool in tools:
            key = self._key(tool)
            if key is None:
                continue
            verdict = self._verdicts.get(key, _UNCHECKED)
            row: dict[str, Any] = {"tool": tool.name, "version": tool.version, "backend": tool.backend_name,
                                   "upstream_tool": tool.backend.tool,
                                   "state": "verified" if verdict is None else
                                   "unverified" if verdict is _UNCHECKED else "drifted"}
            if isinstance(verdict, Drift):
                row.update(kind=verdict.kind, summary=verdict.summary(), diff=verdict.diff,
                           since=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(verdict.since)),
                           matches_again=verdict.matches_again)
            rows.append(row)
        return rows

    def counts(self, tools: Iterable[ToolContract]) -> dict[str, int]:
        found = {"verified": 0, "drifted": 0, "unverified": 0}
        for row in self.view(tools):
            found[row["state"]] += 1
        return found


OPEN = Quarantine(serve_unverified=True)  # no pins checked (tests and tools that build a pipeline by hand)
