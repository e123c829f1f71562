"""``toolproxy import-mcp URL``: draft registry entries from an upstream MCP server's tools/list.

Owns: reading an upstream's tool list with the ``mcp`` SDK client and turning
it into registry YAML for a human to review, with every field that needs a
decision marked ``REVIEW``. The draft fails safe: each tool defaults to
``mode: write``, ``risk: destructive`` and ``idempotency.required: true``, so an
entry committed without thought is treated as the most dangerous kind of tool
(exclusive locks, idempotency keys, unknown outcomes on timeouts, approval
policies for destructive risk) rather than the least. Upstream annotations
(readOnlyHint, ...) are shown as comments only: they are untrusted hints.

Each entry's ``backend.pin`` records what was imported: the digest of the
upstream's definition of the tool and of its whole tool list
(``proxy/drift.py``); the proxy quarantines the tool while the live upstream
differs, and ``toolproxy mcp repin`` (``proxy/authoring/mcp_repin.py``)
records a reviewed change.

Must never: write the registry itself, mark an entry as reviewed, or turn an
upstream hint into execution metadata.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit

import yaml

from . import flow_labels
from ..drift import UNREPRESENTABLE, UpstreamTool, definition_digest, list_digest
from ..telemetry.redaction import looks_secret

__all__ = ["UpstreamTool", "draft", "fetch_tools"]

_NAME = re.compile(r"^[a-zA-Z][a-zA-Z0-9_.-]{0,63}$")
_MAX_TOOLS = 10000
_MAX_DESCRIPTION = 2000
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_SCHEMA_ONE = frozenset({"items", "additionalProperties", "not", "if", "then", "else", "contains",
                         "propertyNames", "unevaluatedItems"})
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
# Argument names that usually carry a secret or a person's data: proposed as sensitive_fields for review.
_SENSITIVE_NAME = re.compile(r"(^|_)(body|message|content|text|note|comment|code|otp|pin|ssn|card|cvv|iban|"
                             r"account|email|phone|address|birth|dob|salary|diagnosis)(_|$)", re.I)


async def fetch_tools(url: str, *, mode: str = "auto", timeout_s: float = 15.0) -> list[UpstreamTool]:
    """Every tool the upstream lists (all pages, at most ``mcp_pins.MAX_PAGES`` of them)."""
    from mcp import Client  # imported here: the CLI's other commands do not need the SDK loaded

    from ..adapters.mcp_pins import read_tools

    async with asyncio.timeout(timeout_s):
        async with Client(url, mode=mode, cache=None) as client:
            return await read_tools(client, max_tools=_MAX_TOOLS)


def draft(tools: Iterable[UpstreamTool], *, url: str, service: str | None = None, path: str | None = None,
          prefix: str = "") -> str:
    """Registry YAML for ``tools``: valid as written, with REVIEW comments on every judgement call."""
    lines = [
        f"# Drafted by `toolproxy import-mcp` from {url}.",
        "# NOT REVIEWED. Upstream descriptions and annotations are untrusted; every tool below defaults",
        "# to mode: write, risk: destructive, idempotency.required: true until a human decides otherwise.",
        "# WITH THESE DEFAULTS EVERY CALL NEEDS AN APPROVAL (the default policy requires one for risk:",
        "# destructive) AND AN Idempotency-Key. To review:",
        "#   1. per tool, set mode (read | write) and risk (read | write | external | financial | destructive)",
        "#      from what the tool really does; a read needs no idempotency key: drop idempotency.required;",
        "#   2. add resources templates for writes, tighten inputSchema, write an outputSchema if the tool",
        "#      returns JSON (without one its content blocks pass through unverified);",
        "#   3. delete the tools the agent must not have (tools not listed here stay refused);",
        "#   4. check each flow label: untrusted where others write the output, sink_arguments for what aims",
        "#      a call (docs/policy-authors.md#argument-provenance);",
        "#   5. `toolproxy check-registry FILE`, then `toolproxy dev --registry FILE` to try it.",
        "# backend.pin holds digests of each upstream tool's definition and of the upstream's tool list as",
        "# imported: the proxy refuses (contract_drift) and hides a tool while its live upstream differs.",
        "# After reviewing a change, `toolproxy mcp repin FILE` prints the diff and records the new digests.",
        "tools:",
    ]
    used: set[str] = set()
    listed = list(tools)
    tool_list = list_digest(listed)
    for tool in listed:
        entry, notes = _entry(tool, url=url, service=service, path=path, prefix=prefix, used=used)
        definition = definition_digest(tool)
        if definition != UNREPRESENTABLE:
            entry["backend"]["pin"] = {"definition": definition, "tool_list": tool_list}
        else:
            notes.append("backend.pin: the upstream's definition has no RFC 8785 form (a number JSON cannot "
                         "carry exactly); the tool is not pinned and not checked for drift.")
        lines.append(f"  # ---- upstream tool {tool.name!r} ----")
        lines.extend(f"  # REVIEW {note}" for note in notes)
        dumped = yaml.safe_dump([entry], sort_keys=False, allow_unicode=True, width=100)
        lines.extend("  " + line for line in dumped.rstrip("\n").split("\n"))
    if not used:
        lines[-1] = "tools: []"
    return "\n".join(lines) + "\n"


def _entry(tool: UpstreamTool, *, url: str, service: str | None, path: str | None, prefix: str,
           used: set[str]) -> tuple[dict[str, Any], list[str]]:
    notes: list[str] = []
    name = _registry_name(prefix + tool.name, used)
    if name != prefix + tool.name:
        notes.append(f"name: {tool.name!r} is not a valid registry name; renamed to {name!r}.")
    hints = ", ".join(f"{k}={v}" for k, v in sorted(tool.annotations.items()) if k.endswith("Hint")) or "none"
    notes.append(f"mode/risk: defaulted to write/destructive. Upstream hints (untrusted): {hints}.")
    notes.append("resources: none declared; add templates (e.g. \"order:{order_id}\") so writes lock what they touch.")
    notes.append("idempotency/timeout_ms/status_endpoint: conservative defaults; a status endpoint enables reconcile.")
    description = _description(tool, notes)
    input_schema, strict, output_schema = _schemas(tool, notes)
    backend: dict[str, Any] = {"type": "mcp"}
    if service:
        backend.update(service=service, path=path or (urlsplit(url).path or "/"))
    else:
        backend["url"] = url
    backend["tool"] = tool.name
    entry: dict[str, Any] = {
        "name": name, "version": "1.0.0", "description": description[:_MAX_DESCRIPTION],
        "mode": "write", "risk": "destructive",
    }
    if not strict:
        entry["strict"] = False
    entry["inputSchema"] = input_schema
    if output_schema is not None:
        entry["outputSchema"] = output_schema
    entry.update({"idempotency": {"required": True}, "timeout_ms": 10000, "backend": backend})
    proposed = _proposed_sensitive(input_schema)
    if proposed:
        entry["sensitive_fields"] = proposed
        notes.append(f"sensitive_fields: proposed from the argument names and formats ({', '.join(proposed)}); keep "
                     "the ones that carry secrets or a person's data, add any other (they are masked for approvers "
                     "and in logs, fingerprinted in records, and never shown to the model in output).")
    else:
        notes.append("sensitive_fields: none proposed; list the arguments that carry secrets or a person's data.")
    flow, flow_notes = flow_labels.proposal(description=description, input_schema=input_schema,
                                            output_schema=output_schema)
    if flow:
        entry["flow"] = flow
    notes.extend(flow_notes)
    return entry, notes


def _proposed_sensitive(input_schema: Any, prefix: str = "", depth: int = 0) -> list[str]:
    """Arguments, at any depth (dotted paths, crossing arrays), whose names suggest a secret or personal data,
    or whose schema says so (``format: email`` / ``password``, ``writeOnly``): a proposal for the reviewer."""
    properties = input_schema.get("properties") if isinstance(input_schema, dict) else None
    if not isinstance(properties, dict) or depth > _PROPOSAL_DEPTH:
        return []
    found: list[str] = []
    for name, sub in properties.items():
        if not isinstance(name, str):
            continue
        if _looks_sensitive(name, sub):
            found.append(prefix + name)
            continue
        while isinstance(sub, dict) and isinstance(sub.get("items"), dict):  # a path crosses arrays
            sub = sub["items"]
        found.extend(_proposed_sensitive(sub, f"{prefix}{name}.", depth + 1))
    return found


_PROPOSAL_DEPTH = 8
_SENSITIVE_FORMATS = frozenset({"email", "idn-email", "password"})


def _looks_sensitive(name: str, schema: Any) -> bool:
    if looks_secret(name) or _SENSITIVE_NAME.search(re.sub(r"(?<=[a-z])(?=[A-Z])", "_", name)):
        return True
    return isinstance(schema, dict) and (schema.get("format") in _SENSITIVE_FORMATS or schema.get("writeOnly") is True)


def _description(tool: UpstreamTool, notes: list[str]) -> str:
    description = (tool.description or "").strip()
    if description:
        notes.append("description: copied from the upstream; it is exactly what the model will read.")
        return description
    notes.append("description: the upstream gave none; write one for the model.")
    return f"Upstream MCP tool {tool.name}."


def _schemas(tool: UpstreamTool, notes: list[str]) -> tuple[Any, bool, Any]:
    """(inputSchema made strict where it can be, whether it could, the object outputSchema or None)."""
    input_schema, strict, tightened, kept_open = _strict_schema(tool.input_schema)
    if tightened:
        notes.append(f"inputSchema: additionalProperties: false added to {tightened} object schema(s).")
    if kept_open:
        notes.append(f"inputSchema: kept open where the upstream says additionalProperties: true "
                     f"({', '.join(kept_open)}): closing them would refuse every value; strict: false set. "
                     f"Declare their properties and close them if you can.")
    elif not strict:
        notes.append("inputSchema: has open maps (additionalProperties is a schema); strict: false set.")
    output_schema = tool.output_schema
    if output_schema is None or output_schema.get("type") != "object":
        output_schema = None
        notes.append("outputSchema: the upstream declares none (or no object one); its content blocks pass "
                     "through unverified. Write one if the tool returns JSON.")
    return input_schema, strict, output_schema


def _registry_name(raw: str, used: set[str]) -> str:
    name = re.sub(r"[^a-zA-Z0-9_.-]", "_", raw)
    if not name or not name[0].isalpha():
        name = "t_" + name
    name = name[:64]
    base, n = name, 2
    while name in used or not _NAME.match(name):
        suffix = f"_{n}"
        name = base[:64 - len(suffix)] + suffix
        n += 1
    used.add(name)
    return name


def _with_sub_schemas(node: dict[str, Any], where: str, walk: Callable[[Any, str], Any]) -> dict[str, Any]:
    """A copy of ``node`` whose sub-schemas (in schema positions only) went through ``walk``."""
    out = dict(node)
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: walk(sub, f"{where}.{key}.{name}") for name, sub in value.items()}
        elif key in _SCHEMA_ONE:
            out[key] = walk(value, f"{where}.{key}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [walk(sub, f"{where}.{key}[{i}]") for i, sub in enumerate(value)]
    return out


def _is_object_schema(schema: dict[str, Any]) -> bool:
    """Whether ``schema`` describes an object: its type says so, or it lists properties."""
    kinds = schema.get("type")
    return kinds == "object" or (isinstance(kinds, list) and "object" in kinds) or "properties" in schema


def _strict_schema(schema: Any) -> tuple[Any, bool, int, list[str]]:
    """A copy of ``schema`` whose object schemas forbid unknown fields where the upstream left it unsaid;
    (copy, strict_possible, changes, where the upstream said ``additionalProperties: true`` and it stays)."""
    strict = True
    changes = 0
    kept_open: list[str] = []

    def walk(node: Any, where: str) -> Any:
        # Only schema positions are entered (as in registry._loose_objects); data keywords
        # such as default, enum and const are copied untouched.
        nonlocal strict, changes
        if not isinstance(node, dict):
            return node
        out = _with_sub_schemas(node, where, walk)
        if _is_object_schema(out) and out.get("unevaluatedProperties") is not False:
            if "additionalProperties" not in out:  # unsaid: JSON Schema's default is open; close it
                out["additionalProperties"] = False
                changes += 1
            elif out["additionalProperties"] is True:  # said on purpose (an open map): closing refuses all
                strict = False
                kept_open.append(where)
            elif out["additionalProperties"] is not False:
                strict = False
        return out

    copy = walk(schema, "inputSchema")
    if isinstance(copy, dict):
        copy.setdefault("type", "object")
    return copy, strict, changes, kept_open
