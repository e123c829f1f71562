"""Compensation declarations in the registry: their shape and their fit to both contracts.

Owns: the frozen ``CompensationSpec`` of a contract (which tool and version undo
its effect, how that tool's arguments are built from the original call's
arguments and result, the states and time window it may start from, the scopes
it needs) and the load-time check that the declaration fits both contracts'
schemas: every mapped JSON pointer names a field the original always has
(required at every level), its declared type fits the compensating argument's
type, every required argument of the compensating tool is mapped, constants
validate against the argument's schema. ``check-registry`` and every registry
load run it. Must never: evaluate code or templates beyond RFC 6901 pointers
and constants, or look at anything but the two contracts.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from jsonschema import Draft202012Validator

SOURCES = ("arguments", "result")  # the first segment of a mapping pointer
_NUMERIC = {"integer": {"integer", "number"}}


@dataclass(frozen=True)
class ArgumentSource:
    """One compensating argument: a pointer into the original call (``/arguments/...``, ``/result/...``)
    or a constant."""

    pointer: str | None = None
    value: Any = None

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(_unescape(p) for p in (self.pointer or "").split("/")[1:])


@dataclass(frozen=True)
class CompensationSpec:
    tool: str
    version: str
    arguments: Mapping[str, ArgumentSource]
    from_states: tuple[str, ...] = ("SUCCEEDED",)
    window_s: int = 3600
    scopes: tuple[str, ...] = ()  # what the caller must hold besides the policy's compensate grant

    def argument_pointers(self) -> tuple[tuple[str, ...], ...]:
        """The ``/arguments/...`` pointers: what the original's record keeps of its arguments."""
        return tuple(source.parts[1:] for source in self.arguments.values()
                     if source.pointer is not None and source.parts[0] == "arguments")

    def to_json(self) -> dict[str, Any]:
        return {"tool": self.tool, "version": self.version, "from_states": list(self.from_states),
                "window_s": self.window_s, "required_scopes": list(self.scopes)}


def spec_from_registry(raw: Mapping[str, Any]) -> CompensationSpec:
    arguments = {name: ArgumentSource(pointer=source) if isinstance(source, str)
                 else ArgumentSource(value=source["value"]) for name, source in raw["arguments"].items()}
    return CompensationSpec(tool=raw["tool"], version=raw["version"], arguments=MappingProxyType(arguments),
                            from_states=tuple(raw.get("from_states", ("SUCCEEDED",))),
                            window_s=raw.get("window_s", 3600),
                            scopes=tuple((raw.get("authority") or {}).get("scopes", ())))


def problems(spec: CompensationSpec, *, original_input: Mapping[str, Any], original_output: Mapping[str, Any],
             original_retention_s: int, target_input: Mapping[str, Any]) -> list[str]:
    """Why the declaration does not fit the two contracts (empty: it fits)."""
    found: list[str] = []
    if spec.window_s > original_retention_s:
        found.append(f"window_s {spec.window_s} outlives the original's record (idempotency.retention_seconds "
                     f"{original_retention_s})")
    found.extend(mapping_problems(spec.arguments, sources={"arguments": original_input, "result": original_output},
                                  target_input=target_input))
    return found


def mapping_problems(arguments: Mapping[str, ArgumentSource], *, sources: Mapping[str, Mapping[str, Any]],
                     target_input: Mapping[str, Any], target: str = "compensating") -> list[str]:
    """Why arguments mapped by pointer (or constant) do not fit the target tool's inputSchema: every required
    target argument mapped, every pointer's first step a source in ``sources`` and every further step a
    required property (the value always exists), its type fitting the target argument's. ``target`` names the
    target tool in the messages (the compensating tool, a related read)."""
    found: list[str] = []
    target_properties = target_input.get("properties") or {}
    for name in target_input.get("required") or ():
        if name not in arguments:
            found.append(f"arguments: required argument {name!r} of the {target} tool is not mapped")
    for name, source in arguments.items():
        wanted = target_properties.get(name)
        if wanted is None:
            found.append(f"arguments.{name}: not a property of the {target} tool's inputSchema")
            continue
        if source.pointer is None:
            if not Draft202012Validator(wanted).is_valid(source.value):
                found.append(f"arguments.{name}: the constant does not match the {target} argument's schema")
            continue
        parts = source.parts
        if parts[0] not in sources:
            found.append(f"arguments.{name}: {source.pointer} does not start with "
                         f"{' or '.join('/' + s for s in sources)}")
            continue
        pointed, problem = _walk(sources[parts[0]], parts[1:])
        if problem:
            found.append(f"arguments.{name}: {source.pointer} {problem}")
            continue
        mismatch = _type_mismatch(pointed, wanted, target)
        if mismatch:
            found.append(f"arguments.{name}: {source.pointer} {mismatch}")
    return found


def inputs_of(spec: CompensationSpec, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """What the original's record keeps for its compensation: the values its ``/arguments/...`` pointers
    name (only those, unredacted: the compensating call needs them exactly)."""
    kept: dict[str, Any] = {}
    for source in spec.arguments.values():
        if source.pointer is not None and source.parts[0] == "arguments":
            value = resolve(arguments, source.parts[1:])
            if value is not _MISSING:
                kept[source.pointer] = value
    return kept


def build_arguments(spec: CompensationSpec, *, inputs: Mapping[str, Any], result: Any) -> dict[str, Any] | None:
    """The compensating call's arguments, or None when the original's record lacks a mapped value."""
    built: dict[str, Any] = {}
    for name, source in spec.arguments.items():
        if source.pointer is None:
            built[name] = source.value
        elif source.parts[0] == "arguments":
            if source.pointer not in inputs:
                return None
            built[name] = inputs[source.pointer]
        else:
            value = resolve(result, source.parts[1:])
            if value is _MISSING:
                return None
            built[name] = value
    return built


_MISSING = object()
MISSING = _MISSING  # what ``resolve`` answers for a value that is not there


def resolve(document: Any, parts: tuple[str, ...]) -> Any:
    for part in parts:
        if isinstance(document, Mapping) and part in document:
            document = document[part]
        else:
            return _MISSING
    return document


def _walk(schema: Mapping[str, Any], parts: tuple[str, ...]) -> tuple[Mapping[str, Any], str | None]:
    """The subschema at ``parts`` if every step is a required property (so the value always exists)."""
    for depth, part in enumerate(parts):
        properties = schema.get("properties") or {}
        if part not in properties:
            return schema, f"is not declared (no property {part!r})"
        if part not in (schema.get("required") or ()):
            return schema, f"may be absent ({part!r} is not required)"
        schema = properties[part]
    return schema, None


def _types(schema: Mapping[str, Any]) -> set[str] | None:
    declared = schema.get("type")
    if declared is None:
        return None
    return {declared} if isinstance(declared, str) else set(declared)


def _type_mismatch(source: Mapping[str, Any], target: Mapping[str, Any], noun: str) -> str | None:
    source_types, target_types = _types(source), _types(target)
    if target_types is not None:
        if source_types is None and "enum" not in source and "const" not in source:
            return f"has no declared type; the {noun} argument wants {sorted(target_types)}"
        widened = set().union(*(_NUMERIC.get(t, {t}) for t in target_types))
        if source_types is not None and not source_types <= widened:
            return f"is {sorted(source_types)}, the {noun} argument wants {sorted(target_types)}"
    if "enum" in target:
        values = source.get("enum") or ([source["const"]] if "const" in source else None)
        if values is None or any(v not in target["enum"] for v in values):
            return f"may hold values outside the {noun} argument's enum"
    return None


def _unescape(part: str) -> str:
    return part.replace("~1", "/").replace("~0", "~")
