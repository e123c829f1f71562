"""The compiled fast path of ``proxy.wire.schema_fast`` never changes a verdict of ``jsonschema``."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from proxy.wire import schema_fast
from proxy.fronts.ingress import api_validator
from proxy.registry import load_registry

REPO = Path(__file__).resolve().parents[2]

# Values of every JSON type, including the ones where Python and Rust could read numbers, equality,
# strings and patterns differently.
VALUES = [None, True, False, 0, 1, -1, 1.0, 0.5, 2**70, -(2**70), 1e300, "", "a", "ord_1001", "ord_1001\n",
          "٣", "😀😀", "x" * 65, "1.2.3", "USD", [], [1, True], [1, 1.0], [[1], [True]], {}, {"a": 1},
          {"a": True}, {"order_id": "ord_1"}, {"order_id": "ord_1", "extra": 1}, {"counter": "c", "delta": 1},
          {"counter": "c", "delta": 1.5}, {"counter": "c", "delta": 2**70}, 2**53, 2**53 + 1, 2.0**53, 2.0**70,
          2**70 + 1]

EDGE_SCHEMAS = [
    {"type": "number", "maximum": 2**53 - 1, "minimum": -0.5},
    {"uniqueItems": True},
    {"enum": [1, [1], {"a": 1}]},
    {"const": False},
    {"type": "string", "pattern": "^ord_[A-Za-z0-9]+$"},
    {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
    {"type": "string", "maxLength": 2, "minLength": 1},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
    {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]},
    {"oneOf": [{"type": "number"}, {"type": "integer"}]},
    {"$defs": {"n": {"type": "number", "minimum": 0}}, "type": "array", "items": {"$ref": "#/$defs/n"}},
    {"if": {"type": "object"}, "then": {"required": ["a"]}, "else": {"not": {"type": "null"}}},
    {"type": "array", "prefixItems": [{"type": "integer"}], "contains": {"const": True}},
]

# Schemas the two engines could decide differently: the fast path stays off, jsonschema alone decides.
NOT_ALIKE = [
    ({"type": "number", "multipleOf": 0.1}, False),           # float arithmetic: Rust accepts 0.3
    ({"type": "string", "format": "email"}, True),            # formats asserted: checkers differ
    ({"type": "string", "pattern": "^\\w+$"}, False),         # \w: Unicode classes differ
    ({"type": "string", "pattern": "^\\D+$"}, False),         # \D: Rust's \d is ASCII here, Python's is not
    ({"type": "string", "pattern": "(?i)^a$"}, False),        # flags
    ({"type": "string", "pattern": "^[[:alpha:]]+$"}, False),  # POSIX class: literal characters to Python
    ({"type": "string", "pattern": "^[a-z&&[^b]]+$"}, False),  # class intersection: literal to Python
    ({"unevaluatedProperties": False}, False),                # outside the keywords held together
    ({"type": "integer", "maximum": 2**70 - 1}, False),       # a bound a float could be rounded onto
    ({"const": 2**70 + 1}, False),                            # 2.0**70 would be "equal" once converted
]


def _agree(fast: schema_fast.FastValidator, exact: Draft202012Validator, value: object) -> None:
    assert fast.is_valid(value) == exact.is_valid(value), (fast.schema, value)
    assert sorted(e.message for e in fast.iter_errors(value)) == sorted(e.message for e in exact.iter_errors(value))


@pytest.mark.parametrize("schema", EDGE_SCHEMAS)
def test_edge_schemas_use_the_fast_path_and_agree(schema):
    fast = schema_fast.validator(schema, formats=True)
    assert fast.fast
    exact = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    for value in VALUES:
        _agree(fast, exact, value)


@pytest.mark.filterwarnings("ignore:Possible:FutureWarning")  # Python's re on the POSIX/intersection cases
@pytest.mark.parametrize("schema,formats", NOT_ALIKE)
def test_schemas_read_differently_stay_with_jsonschema(schema, formats):
    fast = schema_fast.validator(schema, formats=formats)
    assert not fast.fast
    exact = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER if formats else None)
    for value in [*VALUES, 0.3, "abc", "é", "not-an-email"]:
        _agree(fast, exact, value)


def test_a_reference_to_another_document_stays_with_jsonschema():
    assert not schema_fast.validator({"$ref": "https://example.com/s.json"}).fast
    assert not schema_fast.validator({"$id": "https://example.com/a", "$defs": {"b": {"$id": "b.json"}}}).fast


def test_multiple_of_would_differ_without_the_guard():
    # Why multipleOf stays with jsonschema: the compiled validator alone accepts 0.3 as a multiple of 0.1.
    import jsonschema_rs
    assert jsonschema_rs.Draft202012Validator({"multipleOf": 0.1}).is_valid(0.3)
    assert not Draft202012Validator({"multipleOf": 0.1}).is_valid(0.3)


def test_every_shipped_schema_agrees_on_every_value():
    registry = load_registry([REPO / "examples" / "registry"])
    validators = [v for tool in registry.all() for v in (tool.input_validator, tool.output_validator)]
    validators += [api_validator(n) for n in sorted(os.listdir(REPO / "schemas")) if n.endswith("request.schema.json")]
    assert sum(v.fast for v in validators) >= len(validators) - 2  # send_email's input asserts a format
    bodies = [{"call_id": c, "tool": t, "arguments": a} for c, t, a in
              itertools.product(["c1", "c 1"], ["get_order", ""], [{"order_id": "ord_1"}, "{}", 3])]
    for validator in validators:
        exact = Draft202012Validator(validator.schema, format_checker=validator.exact.format_checker)
        for value in [*VALUES, *bodies, {"calls": bodies[:2]}, {"calls": []}]:
            _agree(validator, exact, value)


# check_schema: the registry's check of each contract schema against the 2020-12 metaschema.
KEYWORDS = ["type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
            "minItems", "uniqueItems", "minLength", "maxLength", "pattern", "minimum", "exclusiveMaximum",
            "multipleOf", "allOf", "anyOf", "oneOf", "not", "patternProperties", "dependentRequired",
            "dependentSchemas", "propertyNames", "if", "then", "contains", "maxContains", "$ref", "$defs", "$id",
            "$anchor", "$dynamicRef", "format", "title", "default", "unevaluatedProperties", "$schema",
            "$vocabulary", "$comment", "contentEncoding", "deprecated", "examples", "maxProperties"]
# Values where the engines could part: regexes valid in only one of Python's re and Rust's regex, integers
# written as floats, huge and negative numbers, duplicates where the metaschema wants unique items.
ODD = [None, True, False, 0, 1, -1, 2, 10**20, -(10**20), 0.0, 1.0, 1.5, -2.0, 1e300, float("inf"), "", "a",
       "string", "object", "integer", "[", "\\p{L}", "(?=x)", "(?P<n>a)", "(?<n>a)", "\\Z", "\\z", "[[:alpha:]]",
       "a**", "x{2,1}", "#", "#/$defs/a", "^a$", "\\w", "not a uri ::", ["a", "a"], ["string", "null"], [1, True]]
SCHEMA_EDGES = [{"pattern": "\\p{L}"}, {"pattern": "(?=a)b"}, {"pattern": "["}, {"patternProperties": {"[": {}}},
                {"properties": {"pattern": {"type": "string"}}}, {"minLength": 1.0}, {"minLength": 1.5},
                {"required": ["a", "a"]}, {"enum": [1, True]}, {"type": ["string", "string"]}, {"maximum": 1e400},
                {"$id": "not a uri ::"}, {"propertyNames": {"pattern": "\\w+"}}, {"pattern": "a{2,1}"}, True, False]


def _random_schema(rng, depth: int = 0):
    if rng.random() < 0.1:
        return rng.choice([True, False])
    schema = {}
    for _ in range(rng.randrange(4)):
        keyword = rng.choice(KEYWORDS)
        if depth < 3 and keyword in ("properties", "patternProperties", "$defs", "dependentSchemas"):
            schema[keyword] = {rng.choice(["a", "pattern", "[", "\\p{L}"]): _random_schema(rng, depth + 1)
                               for _ in range(rng.randrange(3))}
        elif depth < 3 and keyword in ("allOf", "anyOf", "oneOf", "prefixItems", "not", "if", "then", "items",
                                       "contains", "additionalProperties", "propertyNames") and rng.random() < 0.7:
            subs = [_random_schema(rng, depth + 1) for _ in range(rng.randrange(3))]
            schema[keyword] = subs if keyword in ("allOf", "anyOf", "oneOf", "prefixItems") else subs[0] if subs else {}
        else:
            schema[keyword] = rng.choice(ODD)
    return schema


def _jsonschema_says(schema) -> str | None:
    try:
        Draft202012Validator.check_schema(schema)
        return None
    except Exception as exc:  # SchemaError
        return exc.message


def _fast_says(schema) -> str | None:
    try:
        schema_fast.check_schema(schema)
        return None
    except Exception as exc:
        return exc.message


def test_the_meta_formats_are_the_ones_the_metaschema_uses():
    from jsonschema_specifications import REGISTRY

    def formats(node):
        if isinstance(node, dict):
            return ({node["format"]} if isinstance(node.get("format"), str) else set()).union(
                *(formats(v) for v in node.values()))
        return set().union(*(formats(v) for v in node)) if isinstance(node, list) else set()

    used = set().union(*(formats(REGISTRY[uri].contents) for uri in REGISTRY
                         if uri.startswith("https://json-schema.org/draft/2020-12/")))
    assert used == schema_fast.META_FORMATS


@pytest.mark.filterwarnings("ignore:Possible:FutureWarning")
def test_check_schema_agrees_with_jsonschema_on_every_verdict_and_message():
    check_schema_agrees(seed=32, random_schemas=400)  # tests/test_schema_fast_sweep.py: 3,000 more, full suite


def check_schema_agrees(*, seed: int, random_schemas: int) -> None:
    import random
    rng = random.Random(seed)
    schemas = [*SCHEMA_EDGES, *EDGE_SCHEMAS, *(s for s, _ in NOT_ALIKE),
               *(_random_schema(rng) for _ in range(random_schemas))]
    refused = 0
    for schema in schemas:
        expected = _jsonschema_says(schema)
        assert _fast_says(schema) == expected, schema
        refused += expected is not None
    assert 0.3 * len(schemas) < refused < 0.8 * len(schemas)  # both verdicts are exercised
