"""What a contract lets an approver see beside a pending approval, beyond the masked arguments.

Owns: the two registry declarations of an approver's context and their
load-time checks — ``related_read`` (a read tool of the registry whose result
the console shows beside the request, e.g. the order a refund applies to, with
its arguments mapped by RFC 6901 pointer from the request's arguments or given
as constants) and ``approver_may_read`` (entries of ``sensitive_fields`` an
approver may read in clear while the approval waits) — and building both from
one normalized call: the read's arguments and the approver's copy of the
fields. ``check-registry`` and every registry load run the checks. Must never:
map a sensitive or credential-like argument into a read (its arguments are shown
to approvers and go through the audit trail), name anything but a read of this
registry, or let a credential-like field be read by a person.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from . import compensation_contract
from .compensation_contract import ArgumentSource
from .telemetry.redaction import looks_secret, select

MAX_RELATED_READS = 8  # related reads one proxy runs at once for approvers (more: refused, try again)


@dataclass(frozen=True)
class RelatedRead:
    """The read a contract shows beside its pending approvals: tool, version and the read's arguments."""

    tool: str
    version: str
    arguments: Mapping[str, ArgumentSource]

    def build(self, arguments: Mapping[str, Any]) -> dict[str, Any] | None:
        """The read's arguments from the request's normalized arguments (None when a mapped value is absent,
        which the load-time check rules out for a request that passed its schema)."""
        built: dict[str, Any] = {}
        for name, source in self.arguments.items():
            if source.pointer is None:
                built[name] = source.value
                continue
            value = compensation_contract.resolve(arguments, source.parts[1:])
            if value is compensation_contract.MISSING:
                return None
            built[name] = value
        return built


def related_from_registry(raw: Mapping[str, Any] | None) -> RelatedRead | None:
    if not raw:
        return None
    arguments = {name: ArgumentSource(pointer=source) if isinstance(source, str)
                 else ArgumentSource(value=source["value"]) for name, source in raw["arguments"].items()}
    return RelatedRead(tool=raw["tool"], version=raw["version"], arguments=MappingProxyType(arguments))


def readable_problems(approver_may_read: Iterable[str], sensitive_fields: Iterable[str]) -> list[str]:
    """Why an ``approver_may_read`` list does not fit the contract (empty: it fits)."""
    sensitive = set(sensitive_fields)
    found: list[str] = []
    for index, path in enumerate(approver_may_read):
        if path not in sensitive:
            found.append(f"[{index}]: {path!r} is not one of sensitive_fields (an approver already sees it)")
        elif any(looks_secret(part) for part in path.split(".")):
            found.append(f"[{index}]: {path!r} looks like a credential; no person is shown one")
    return found


def related_problems(read: RelatedRead, *, request_input: Mapping[str, Any], sensitive_fields: Iterable[str],
                     target_mode: str, target_input: Mapping[str, Any], target_sink: str = "internal",
                     target_risk: str = "read") -> list[str]:
    """Why a ``related_read`` does not fit the request's contract and the read's (empty: it fits)."""
    found: list[str] = []
    if target_mode != "read":
        found.append(f"{read.tool}@{read.version} is a {target_mode}, not a read (an approver's look never "
                     f"changes anything)")
    elif target_sink == "external" or target_risk != "read":
        # Its arguments come from the pending request (the agent's words) and it runs when an approver merely
        # opens the approval, before anyone decided: a sink would send them out unapproved.
        found.append(f"{read.tool}@{read.version} is an external sink (flow.sink: {target_sink}, risk: "
                     f"{target_risk}), not an internal read (opening an approval must send nothing out)")
    sensitive = [tuple(p.split(".")) for p in sensitive_fields]
    for name, source in read.arguments.items():
        if source.pointer is None:
            continue
        parts = source.parts[1:]
        if any(parts[:len(p)] == p for p in sensitive) or any(looks_secret(part) for part in parts):
            found.append(f"arguments.{name}: {source.pointer} is a sensitive field (the read's arguments are "
                         f"shown to approvers and audited)")
    found.extend(compensation_contract.mapping_problems(read.arguments, sources={"arguments": request_input},
                                                        target_input=target_input, target="related read"))
    return found


def approver_copy(arguments: Any, approver_may_read: Iterable[str], salt: str, *,
                  key: bytes) -> dict[str, Any] | None:
    """The sensitive fields an approver may read, in clear, in the arguments' own shape (credential-like keys
    below them still hashed under ``key``); None when the contract lets an approver read none."""
    paths = list(approver_may_read)
    if not paths:
        return None
    return select(arguments, paths, salt, key=key)
