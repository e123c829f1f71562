"""The demo registry against its schema and the demo backend's routes (files only, no processes)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from examples.demo_backend import TOOLS
from tests.unit import REPO as ROOT, load_yaml

GOOD_ARGS: dict[str, dict[str, Any]] = {
    "get_order": {"order_id": "ord_1001"},
    "get_orders": {"order_ids": ["ord_1001", "ord_1002"]},
    "refund_order": {"order_id": "ord_1001", "amount": 500, "reason": "damaged"},
    "reserve_inventory": {"sku": "sku_widget", "quantity": 2, "order_id": "ord_1001"},
    "get_inventory": {"sku": "sku_widget"},
    "send_email": {"to": "ada@example.com", "subject": "Hi", "body": "Your refund is on its way."},
    "get_user_preferences": {"user_ref": "usr_alice"},
    "fetch_page": {"url": "https://shop.example/help"},
    "send_confirmation": {"order_id": "ord_1002", "channel": "email"},
    "adjust_counter": {"counter": "ctr_demo", "delta": 3},
    "get_counter": {"counter": "ctr_demo"},
    "get_project": {"project_id": "prj_1001"},
    "delete_customer": {"customer_id": "cus_1002"},
    "release_reservation": {"reservation_id": "rsv_seed1", "sku": "sku_gizmo", "quantity": 1},
    "generate_report": {"title": "weekly", "duration_ms": 20},
    "transfer_project": {"project_id": "prj_1001", "to_owner": "bob", "expected_owner": "dev-user"},
    "rename_project": {"project_id": "prj_1001", "name": "Apollo"},
    "send_notices": {"recipients": ["usr_alice"], "message": "hello"},
}


REGISTRY = load_yaml(ROOT / "examples/registry/demo-tools.yaml")


REGISTRY_SCHEMA = json.loads((ROOT / "schemas/tool-registry.schema.json").read_text())


CONTRACTS = {tool["name"]: tool for tool in REGISTRY["tools"]}


def test_registry_is_valid_against_the_schema():
    jsonschema.Draft202012Validator(REGISTRY_SCHEMA).validate(REGISTRY)
    for tool in REGISTRY["tools"]:
        jsonschema.Draft202012Validator.check_schema(tool["inputSchema"])
        jsonschema.Draft202012Validator.check_schema(tool["outputSchema"])


def _object_schemas(schema: Any):
    if isinstance(schema, dict):
        if schema.get("type") == "object":
            yield schema
        for value in schema.values():
            yield from _object_schemas(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _object_schemas(value)


def test_registry_schemas_are_closed_and_complete():
    for tool in REGISTRY["tools"]:
        for part in ("inputSchema", "outputSchema"):
            objects = list(_object_schemas(tool[part]))
            assert objects, (tool["name"], part)
            for obj in objects:
                assert obj.get("additionalProperties") is False, (tool["name"], part)
                assert set(obj["required"]) == set(obj["properties"]), (tool["name"], part)


def test_registry_matches_the_backend():
    assert set(CONTRACTS) == set(TOOLS)
    for name, contract in CONTRACTS.items():
        spec = TOOLS[name]
        assert contract["backend"] == {"type": "http", "service": "demo", "path": f"/tools/{name}"}
        assert (contract["mode"] == "write") == spec.writes, name
        assert tuple(r["template"] for r in contract.get("resources", [])) == spec.resources, name
        assert set(contract["inputSchema"]["properties"]) == set(spec.fields), name
        if contract.get("status_endpoint"):
            assert contract["status_endpoint"] == {"service": "demo", "path": f"/status/{name}"}
        jsonschema.validate(GOOD_ARGS[name], contract["inputSchema"])
