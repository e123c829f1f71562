"""``toolproxy registry diff OLD NEW`` and ``check-registry --previous``: what changed between two registries.

Owns: comparing contracts per tool and version and classifying each change
(bump the version when arguments, results or permission
semantics change). Breaking: a new required argument, a narrowed type or
enum, a removed input property, a removed or newly optional output field (in the outputSchema, or in
what the model is shown of it: ``output_filter``), a narrower ``output_limit``, read → write,
higher risk, a new resource template, idempotency newly required, a new
``flow.produces`` label or ``flow.sink`` becoming external, a removed version. Everything else is compatible (descriptions, timeouts, backends,
status changes, new optional arguments, widened enums).

A new version is compared with the newest version of the same tool in OLD, so
a reviewer sees what the bump covers. ``same_version_breaks`` is the CI gate:
a breaking change that keeps the version number.

Must never: execute anything, or call a change compatible without having
compared it (unknown schema keywords that changed are reported compatible
only when they are pure annotations).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from ..registry import Registry, ToolContract, thaw

RISK_ORDER = ("read", "write", "external", "financial", "destructive")
_ANNOTATIONS = {"description", "title", "examples", "$comment", "default"}


@dataclass(frozen=True)
class Change:
    tool: str
    version: str          # the version in NEW (or the removed one)
    against: str | None   # the version in OLD it was compared with (None: a new tool)
    breaking: bool
    what: str

    def line(self) -> str:
        label = "BREAKING  " if self.breaking else "compatible"
        base = "" if self.against in (None, self.version) else f" (against {self.against})"
        return f"{label} {self.tool}@{self.version}{base}: {self.what}"


def diff(old: Registry, new: Registry) -> list[Change]:
    changes: list[Change] = []
    old_by_name: dict[str, dict[str, ToolContract]] = {}
    for tool in old.all():
        old_by_name.setdefault(tool.name, {})[tool.version] = tool
    new_keys = {(t.name, t.version) for t in new.all()}
    for tool in new.all():
        versions = old_by_name.get(tool.name, {})
        if tool.version in versions:
            changes.extend(compare(versions[tool.version], tool))
        elif versions:
            newest = max(versions.values(), key=lambda t: _key(t.version))
            found = compare(newest, tool)
            changes.append(Change(tool.name, tool.version, newest.version, False, "new version"))
            changes.extend(found)
        else:
            changes.append(Change(tool.name, tool.version, None, False, "new tool"))
    for name, versions in old_by_name.items():
        for version in versions:
            if (name, version) not in new_keys:
                changes.append(Change(name, version, version, True,
                                      "version removed (retire it first: status: retired keeps records readable)"))
    return changes


def same_version_breaks(changes: list[Change]) -> list[Change]:
    return [c for c in changes if c.breaking and c.against == c.version]


def compare(old: ToolContract, new: ToolContract) -> list[Change]:
    found = _contract_fields(old, new)
    found.extend(_schema(thaw(old.input_schema), thaw(new.input_schema), "input", "$"))
    found.extend(_schema(thaw(old.output_schema), thaw(new.output_schema), "output", "$"))
    if old.output_policy != new.output_policy:  # what the model is shown changed (output_filter, output_limit)
        found.extend(_model_output(old, new))
    return [Change(new.name, new.version, old.version, breaking, what) for breaking, what in found]


def _contract_fields(old: ToolContract, new: ToolContract) -> list[tuple[bool, str]]:
    """Mode, risk, resources, key requirement and lifecycle: (breaking, what changed)."""
    found: list[tuple[bool, str]] = []
    if old.mode != new.mode:
        found.append((old.mode == "read" and new.mode == "write", f"mode {old.mode} -> {new.mode}"))
    if old.risk != new.risk:
        found.append((RISK_ORDER.index(new.risk) > RISK_ORDER.index(old.risk), f"risk {old.risk} -> {new.risk}"))
    old_templates, new_templates = {r.template for r in old.resources}, {r.template for r in new.resources}
    found += [(True, f"new resource template {t}") for t in sorted(new_templates - old_templates)]
    found += [(False, f"resource template removed {t}") for t in sorted(old_templates - new_templates)]
    if old.idempotency_required != new.idempotency_required:
        found.append((new.idempotency_required, f"idempotency.required {old.idempotency_required} -> "
                                                f"{new.idempotency_required}"))
    if old.status != new.status:
        found.append((False, f"status {old.status} -> {new.status}"))
    return found + _flow_fields(old, new) + _informative_fields(old, new)


def _flow_fields(old: ToolContract, new: ToolContract) -> list[tuple[bool, str]]:
    """Flow facts are permission semantics: a new label or an external sink can hold calls that ran before."""
    found = [(True, f"flow.produces adds {label}") for label in new.flow_produces if label not in old.flow_produces]
    found += [(False, f"flow.produces drops {label}") for label in old.flow_produces if label not in new.flow_produces]
    if old.flow_sink != new.flow_sink:
        found.append((new.flow_sink == "external", f"flow.sink {old.flow_sink} -> {new.flow_sink}"))
    found += _paths("flow.sink_arguments", old.flow_sink_arguments, new.flow_sink_arguments)
    found += _paths("flow.payload_arguments", old.flow_payload_arguments, new.flow_payload_arguments)
    if old.flow_directory != new.flow_directory:  # a new directory can spare writes aimed at its entries
        found.append((old.flow_directory, f"flow.directory {old.flow_directory} -> {new.flow_directory}"))
    if old.flow_integrity != new.flow_integrity:
        found.append((new.flow_integrity is not None, f"flow.integrity {old.flow_integrity} -> {new.flow_integrity}"))
    if old.flow_trusted_source != new.flow_trusted_source:  # no longer trusting a source holds values it cleared
        found.append((old.flow_trusted_source, f"flow.trusted_source {old.flow_trusted_source} -> {new.flow_trusted_source}"))
    return found


def _paths(name: str, old: tuple[str, ...], new: tuple[str, ...]) -> list[tuple[bool, str]]:
    """Argument paths added (they can hold calls that ran before) and dropped."""
    return [(True, f"{name} adds {p}") for p in new if p not in old] + \
        [(False, f"{name} drops {p}") for p in old if p not in new]


def _informative_fields(old: ToolContract, new: ToolContract) -> list[tuple[bool, str]]:
    informative = ("description", "timeout_ms", "deprecated_at", "sunset", "replaced_by")
    found = [(False, f"{label} changed") for label in informative if getattr(old, label) != getattr(new, label)]
    if replace(old.backend, pin=None) != replace(new.backend, pin=None):
        found.append((False, "backend changed"))
    if old.backend.pin != new.backend.pin:  # `toolproxy mcp repin` after a reviewed upstream change
        found.append((False, "backend.pin changed (the MCP upstream was re-pinned)"))
    return found


def _model_output(old: ToolContract, new: ToolContract) -> list[tuple[bool, str]]:
    found = _schema(thaw(old.visible_output_schema), thaw(new.visible_output_schema), "model output", "$")
    if new.output_policy.max_bytes is not None and (old.output_policy.max_bytes is None or
                                                    new.output_policy.max_bytes < old.output_policy.max_bytes):
        found.append((True, "output_limit narrowed: results the model saw whole may now be truncated or refused"))
    return found


def _schema(old: Any, new: Any, side: str, path: str) -> list[tuple[bool, str]]:
    """Input side: narrowing breaks callers. Output side: losing a field breaks consumers.
    Each entry is (breaking, what changed)."""
    if not isinstance(old, Mapping) or not isinstance(new, Mapping):
        return [] if old == new else [(True, f"{side} {path}: schema replaced")]
    is_input = side == "input"
    found = _type_and_enum(old, new, side, path, is_input) + _properties(old, new, side, path, is_input)
    if "items" in old or "items" in new:
        found.extend(_schema(old.get("items", {}), new.get("items", {}), side, f"{path}[]"))
    handled = {"type", "enum", "properties", "required", "items", *_ANNOTATIONS}
    for keyword in sorted((set(old) | set(new)) - handled):
        if old.get(keyword) != new.get(keyword):
            # pattern, bounds, formats, additionalProperties...: a constraint changed, read as a narrowing
            # on the input side (tell the reviewer; a bump is the safe answer), informative on the output side.
            found.append((is_input, f"{side} {path}: {keyword} changed"))
    return found


def _type_and_enum(old: Mapping[str, Any], new: Mapping[str, Any], side: str, path: str,
                   is_input: bool) -> list[tuple[bool, str]]:
    return [c for c in (_type_change(old, new, side, path, is_input), _enum_change(old, new, side, path, is_input))
            if c is not None]


def _type_change(old: Mapping[str, Any], new: Mapping[str, Any], side: str, path: str,
                 is_input: bool) -> tuple[bool, str] | None:
    old_types, new_types = _types(old), _types(new)
    if old_types == new_types:
        return None
    narrowed = old_types is None or (new_types is not None and not old_types <= new_types)
    widened = new_types is None or (old_types is not None and not new_types <= old_types)
    return (narrowed if is_input else widened), f"{side} {path}: type {_show(old_types)} -> {_show(new_types)}"


def _enum_change(old: Mapping[str, Any], new: Mapping[str, Any], side: str, path: str,
                 is_input: bool) -> tuple[bool, str] | None:
    if "enum" not in old and "enum" not in new:
        return None
    before, after = old.get("enum"), new.get("enum")
    lost = before is None or (after is not None and any(v not in after for v in before))
    gained = after is None or (before is not None and any(v not in before for v in after))
    if not (lost or gained):
        return None
    return ((lost and is_input) or (gained and not is_input)), f"{side} {path}: enum changed"


def _properties(old: Mapping[str, Any], new: Mapping[str, Any], side: str, path: str,
                is_input: bool) -> list[tuple[bool, str]]:
    found: list[tuple[bool, str]] = []
    old_props, new_props = old.get("properties") or {}, new.get("properties") or {}
    old_req, new_req = set(old.get("required") or ()), set(new.get("required") or ())
    found += [(is_input, f"{side} {path}.{name}: now required") for name in sorted(new_req - old_req)]
    found += [(not is_input, f"{side} {path}.{name}: no longer required") for name in sorted(old_req - new_req)]
    found += [(True, f"{side} {path}.{name}: removed") for name in sorted(set(old_props) - set(new_props))]
    found += [(False, f"{side} {path}.{name}: added") for name in sorted(set(new_props) - set(old_props))]
    for name in sorted(set(old_props) & set(new_props)):
        found.extend(_schema(old_props[name], new_props[name], side, f"{path}.{name}"))
    return found


def _types(schema: Mapping[str, Any]) -> frozenset[str] | None:
    value = schema.get("type")
    if value is None:
        return None
    types = frozenset([value] if isinstance(value, str) else value)
    return types | {"integer"} if "number" in types else types


def _show(types: frozenset[str] | None) -> str:
    return "any" if types is None else "|".join(sorted(types))


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))
