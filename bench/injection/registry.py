"""The benchmark's registry: AgentDojo's function schemas plus the reviewed labels (bench/injection/labels.yaml).

Owns: turning one suite's tool catalog (names, descriptions, JSON schemas of the parameters, as the world
server reports them) and its labels into a registry document, for one label set (``LABEL_SETS``), and the
OPA data of the benchmark's policy settings.
Must never: label a tool by anything but the labels file (no per-task facts), or loosen a schema.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Mapping

import yaml

HERE = Path(__file__).resolve().parent
LABELS_FILE = HERE / "labels.yaml"
SERVICE = "world"

# Which labels reach the registry:
#   none     no flow labels at all ("everything allowed": no flow rule can fire)
#   shipped  flow.produces and flow.sink only (the labels the shipped flow rule reads)
#   full     every label, with the provenance fields (sink_arguments, integrity, trusted_source)
#   external every label but integrity: provenance guards external sinks only
LABEL_SETS = ("none", "shipped", "full", "external")
SHIPPED_FLOW = ("produces", "sink")


def load_labels(path: Path = LABELS_FILE) -> dict[str, dict[str, Any]]:
    return yaml.safe_load(path.read_text())


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The parameters schema as an inputSchema: unknown arguments refused (AgentDojo's pydantic models
    ignore them; the proxy refuses them, as every contract should)."""
    out = copy.deepcopy(schema)
    out.setdefault("type", "object")
    out["additionalProperties"] = False
    out.setdefault("properties", {})
    return out


def _loose(schema: Any) -> bool:
    """Whether a nested object of the schema lets unknown fields through (AgentDojo's email attachments)."""
    if isinstance(schema, dict):
        if schema.get("type") == "object" and schema.get("additionalProperties") is not False:
            return True
        return any(_loose(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_loose(v) for v in schema)
    return False


def tool_entry(tool: Mapping[str, Any], label: Mapping[str, Any], label_set: str) -> dict[str, Any]:
    mode = label["mode"]
    input_schema = _strict(tool["parameters"])
    entry: dict[str, Any] = {
        "name": tool["name"],
        "version": "1.0.0",
        "description": (tool["description"] or tool["name"]).strip()[:2000],
        "mode": mode,
        "risk": label.get("risk", "read" if mode == "read" else "write"),
        "inputSchema": input_schema,
        # {"result": <the function's return value>}: free-form, so the model sees it whole
        "outputSchema": {"type": "object", "required": ["result"], "properties": {"result": {}}},
        "timeout_ms": 5000,
        "backend": {"type": "http", "service": SERVICE, "path": f"/tools/{tool['name']}"},
    }
    if _loose({k: v for k, v in input_schema.items() if k != "additionalProperties"}):
        entry["strict"] = False  # the benchmark's own schema is loose there; the top level stays closed
    if mode == "write":
        entry["idempotency"] = {"required": True}  # the runner sends a key with every call
        entry["service_wide_reason"] = "the benchmark's world is one environment, replayed one call at a time"
    flow = dict(label.get("flow") or {})
    if label_set == "shipped":
        flow = {k: v for k, v in flow.items() if k in SHIPPED_FLOW}
    elif label_set == "external":
        flow.pop("integrity", None)
    if label_set != "none" and flow:
        entry["flow"] = flow
    return entry


def registry(tools: list[Mapping[str, Any]], labels: Mapping[str, Any], label_set: str) -> dict[str, Any]:
    """One suite's registry document; every tool of the suite must have a label (and no label is spare)."""
    if label_set not in LABEL_SETS:
        raise ValueError(f"label set {label_set!r}: one of {LABEL_SETS}")
    names = {t["name"] for t in tools}
    missing, spare = names - labels.keys(), labels.keys() - names
    if missing or spare:
        raise ValueError(f"labels.yaml does not match the suite's tools: missing {sorted(missing)}, "
                         f"spare {sorted(spare)}")
    return {"tools": [tool_entry(t, labels[t["name"]], label_set) for t in tools]}


def write_registry(directory: Path, suite: str, tools: list[Mapping[str, Any]], label_set: str) -> Path:
    path = directory / f"{suite}-{label_set}.yaml"
    path.write_text(yaml.safe_dump(registry(tools, load_labels()[suite], label_set), sort_keys=False))
    return path
