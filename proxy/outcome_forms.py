"""The outcome an operation record keeps, and the full outcome every reader gets back.

Owns: which fields of a call's stored outcome (``idempotency.outcome_of``) a record leaves out because
they can be derived, and putting them back when the record is read (a record's Redis bytes
are paid once per write across the fleet, for its whole retention). Derivable are:

- ``call_id``, ``request_id`` and ``tool_version``: the record's meta holds the same values;
- ``error`` when it is null;
- a SUCCEEDED write's ``side_effect``: attempted, committed, and the summary the envelope builds from the
  contract's name and the resource keys (``envelope.effect_summary``);
- the evidence's ``resource_keys`` (the call's resource keys, which the meta's target holds) and its
  ``result_digest`` (the digest of the stored data).

The stored form names what it left out in one short field (``~``, a letter per field), so reading back
fills exactly those and never invents a field a record did not have (an operator's resolution, a
reconciled outcome without a digest).

Must never: leave out a value that differs from its derivation (``compact`` compares each one, so
``expand(compact(o)) == o``), or touch what the record MAC covers (the MAC is over the stored text).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .envelope import effect_summary
from .normalize import digest

DERIVED = "~"  # the stored outcome's field naming what was left out


@dataclass(frozen=True)
class OutcomeContext:
    """What a record's outcome can be derived from: its meta (or, on a replay, the same call again)."""

    state: str
    tool: str | None
    tool_version: str | None
    call_id: str | None
    request_id: str | None
    resources: tuple[str, ...]

    @classmethod
    def of_meta(cls, state: str, meta: Mapping[str, Any]) -> "OutcomeContext":
        target = meta.get("target") if isinstance(meta.get("target"), Mapping) else {}
        return cls(state=state, tool=meta.get("tool"), tool_version=meta.get("tool_version"),
                   call_id=meta.get("call_id"), request_id=meta.get("request_id"),
                   resources=tuple(target.get("resources") or ()))


# letter -> (top-level field, what it equals in a context)
_COPIES = {"c": "call_id", "r": "request_id", "v": "tool_version"}


def compact(outcome: Mapping[str, Any], ctx: OutcomeContext) -> dict[str, Any]:
    """The stored form of ``outcome``: what can be derived from ``ctx`` and the data left out, and named."""
    stored = dict(outcome)
    left: list[str] = []
    for letter, name in _COPIES.items():
        if name in stored and stored[name] == getattr(ctx, name):
            del stored[name]
            left.append(letter)
    if "error" in stored and stored["error"] is None:
        del stored["error"]
        left.append("e")
    if "side_effect" in stored and stored["side_effect"] == _implied_side_effect(ctx, stored.get("partial")):
        del stored["side_effect"]
        left.append("s")
    evidence = stored.get("evidence")
    if isinstance(evidence, Mapping):
        evidence = dict(evidence)
        if evidence.get("resource_keys") == list(ctx.resources):
            del evidence["resource_keys"]
            left.append("k")
        if "result_digest" in evidence and "data" in stored and evidence["result_digest"] == digest(stored["data"]):
            del evidence["result_digest"]
            left.append("d")
        stored["evidence"] = evidence
    if left:
        stored[DERIVED] = "".join(left)
    return stored


def expand(stored: Mapping[str, Any], ctx: OutcomeContext) -> dict[str, Any]:
    """The full outcome of a stored one (an earlier version's full outcome is returned as it is)."""
    left = stored.get(DERIVED)
    if not isinstance(left, str):
        return dict(stored)
    full = {k: v for k, v in stored.items() if k != DERIVED}
    for letter, name in _COPIES.items():
        if letter in left:
            full[name] = getattr(ctx, name)
    if "e" in left:
        full["error"] = None
    if "s" in left:
        full["side_effect"] = _implied_side_effect(ctx, full.get("partial"))
    evidence = full.get("evidence")
    if isinstance(evidence, Mapping) and ("k" in left or "d" in left):
        evidence = dict(evidence)
        if "k" in left:
            evidence["resource_keys"] = list(ctx.resources)
        if "d" in left:
            evidence["result_digest"] = digest(full.get("data"))
        full["evidence"] = evidence
    return full


def _implied_side_effect(ctx: OutcomeContext, partial: Any) -> dict[str, Any] | None:
    """A SUCCEEDED write's side effect as the envelope states it (None for any other state: kept as recorded)."""
    if ctx.state != "SUCCEEDED" or partial is not None or ctx.tool is None:
        return None
    return {"attempted": True, "committed": True,
            "summary": effect_summary(ctx.tool, ctx.tool_version, ctx.resources)}
