"""The independent check after a write: a contract's ``verify_read``.

Owns: what a write contract declares to have its commit checked by a read of
another tool of the registry (``verify_read: {tool, version, arguments, expect}``),
whether that declaration fits both contracts, the read's arguments (pointers into
the write's arguments and verified result, or constants), and comparing what the
read observed with what the write claimed (``expect``: a pointer into the read's
result -> a pointer into the write's ``/arguments`` or ``/result``). A difference,
or a read that gives no answer to compare, is ``VerifyMismatch``: the write's
outcome is no longer known, and its record goes to a person (a takeover whose
evidence holds both values). Must never: call a backend itself (the pipeline
sends the read, under the write's lock), treat a read that failed as a
confirmation, or show the values to the model (they go to the record only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from .compensation_contract import MISSING, ArgumentSource, mapping_problems, resolve
from .errors import ProxyError

WRITE_SOURCES = ("arguments", "result")
MAX_SHOWN_CHARS = 512  # each value a takeover's evidence keeps (the read's and the write's)


@dataclass(frozen=True)
class VerifyRead:
    tool: str
    version: str
    arguments: Mapping[str, ArgumentSource]
    expect: tuple[tuple[str, str], ...]  # (pointer into the read's result, pointer into the write)


def from_registry(raw: Mapping[str, Any] | None) -> VerifyRead | None:
    if not raw:
        return None
    arguments = {name: ArgumentSource(pointer=source) if isinstance(source, str)
                 else ArgumentSource(value=source["value"]) for name, source in raw["arguments"].items()}
    return VerifyRead(tool=raw["tool"], version=raw["version"], arguments=MappingProxyType(arguments),
                      expect=tuple(sorted(raw["expect"].items())))


def problems(read: VerifyRead, *, write_input: Mapping[str, Any], write_output: Mapping[str, Any],
             target_mode: str, target_input: Mapping[str, Any]) -> list[str]:
    """Why a ``verify_read`` does not fit the write's contract and the read's (empty: it fits)."""
    found: list[str] = []
    if target_mode != "read":
        found.append(f"{read.tool}@{read.version} is not a read (mode: {target_mode}): a check must change nothing")
    if not write_output:
        found.append("the write declares no outputSchema, so there is no verified result to compare")
    found.extend(mapping_problems(read.arguments, sources={"arguments": write_input, "result": write_output},
                                  target_input=target_input, target="verify read"))
    for observed, claimed in read.expect:
        if claimed.split("/")[1:2] not in (["arguments"], ["result"]):
            found.append(f"expect.{observed}: {claimed} does not start with /arguments or /result")
    return found


def read_arguments(read: VerifyRead, *, arguments: Mapping[str, Any], result: Any) -> dict[str, Any] | None:
    """The read's arguments from the write's arguments and result (None: a mapped value is missing)."""
    sources = {"arguments": arguments, "result": result}
    built: dict[str, Any] = {}
    for name, source in read.arguments.items():
        value = source.value if source.pointer is None else resolve(sources, source.parts)
        if value is MISSING:
            return None
        built[name] = value
    return built


def differences(read: VerifyRead, *, arguments: Mapping[str, Any], result: Any, observed: Any
                ) -> list[dict[str, Any]]:
    """Each ``expect`` pair whose values differ: the read's (``observed``) beside the write's (``claimed``)."""
    sources = {"arguments": arguments, "result": result}
    found = []
    for read_pointer, write_pointer in read.expect:
        seen = resolve(observed, _parts(read_pointer))
        claimed = resolve(sources, _parts(write_pointer))
        if seen is MISSING or claimed is MISSING or seen != claimed:
            found.append({"read": read_pointer, "observed": _shown(seen), "write": write_pointer,
                          "claimed": _shown(claimed)})
    return found


def pointed(value: Any, pointer: str) -> Any:
    """The value at a JSON pointer into a read's result (``MISSING`` when there is none)."""
    return resolve(value, _parts(pointer))


class VerifyMismatch(ProxyError):
    """The write's backend said it committed, and the independent read says otherwise (or could not say):
    the outcome is unknown and a person takes it over. ``evidence`` goes to the operation record only."""

    def __init__(self, read: VerifyRead, evidence: Mapping[str, Any]) -> None:
        super().__init__("verification_mismatch",
                         "The backend reported this write as done, but the check read afterwards does not show "
                         "it. Whether it took effect is unknown; an operator takes it over. Do not repeat it.",
                         details={"verify_read": f"{read.tool}@{read.version}"}, phase="verify",
                         attempted=True, committed=None)
        self.evidence = dict(evidence)


def mismatch(read: VerifyRead, *, differences_found: list[dict[str, Any]] | None = None,
             read_error: ProxyError | None = None) -> VerifyMismatch:
    """The takeover's evidence: the values that differ, or why the read gave nothing to compare."""
    evidence: dict[str, Any] = {"source": "verify_read", "verify_read": f"{read.tool}@{read.version}"}
    if read_error is not None:
        evidence.update(observed="verify_read_failed", read_error=read_error.code)
    else:
        evidence.update(observed="verify_read_mismatch", differences=differences_found or [])
    return VerifyMismatch(read, evidence)


def _parts(pointer: str) -> tuple[str, ...]:
    return ArgumentSource(pointer=pointer).parts


def _shown(value: Any) -> Any:
    """A value as the evidence keeps it: as is when small, else the start of its JSON (a record stays
    bounded)."""
    if value is MISSING:
        return None
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)
    return value if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS]
