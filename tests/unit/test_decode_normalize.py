"""Decode and normalize stages in isolation."""

from __future__ import annotations

import re

import pytest
from jsonschema import Draft202012Validator

from proxy.decode import decode_arguments, strict_loads
from proxy.errors import ProxyError
from proxy.normalize import canonical_json, normalize, render_template
from proxy.registry import load_registry
from tests.unit import DEMO_REGISTRY

SCHEMA = Draft202012Validator({
    "type": "object", "additionalProperties": False,
    "properties": {"order_id": {"type": "string"}, "amount": {"type": ["integer", "null"], "minimum": 1},
                   "items": {"type": "array", "items": {"type": "object", "additionalProperties": False,
                                                         "properties": {"sku": {"type": "string"}}}}},
    "required": ["order_id", "amount"],
})


def code_of(fn, *args):
    with pytest.raises(ProxyError) as info:
        fn(*args)
    return info.value


def test_duplicate_keys_are_invalid_json_even_when_nested():
    error = code_of(strict_loads, '{"a": {"b": 1, "b": 2}}')
    assert error.code == "invalid_json" and error.details["key"] == "b"


@pytest.mark.parametrize("text", ["NaN", "[Infinity]", "[-Infinity]", "{} x", "", "   ", "{'a': 1}", "True"])
def test_non_json_literals_are_refused(text):
    assert code_of(strict_loads, text).code == "invalid_json"


@pytest.mark.parametrize("text", ["NaN", "[Infinity]", "{} x", "", "{'a': 1}", "True", '{"a": ', '{"a" 1}', "[1,]",
                                  b"\xff", '"\\x"'])
def test_a_parse_error_says_a_fixed_message_never_the_parsers_own_text(text):
    message = code_of(strict_loads, text).message
    assert re.fullmatch(r"tool arguments are not valid (JSON at line \d+, column \d+|UTF-8|JSON: extra data after "
                        r"the value|JSON: NaN and Infinity are not JSON numbers)", message), message


def test_a_parse_error_says_where_and_agrees_with_its_subject():
    with pytest.raises(ProxyError) as info:
        strict_loads('{"a":\n  1,,}', what="request body")
    assert info.value.message == \
        "request body is not valid JSON at line 2, column 5"


def test_whitespace_around_a_value_is_fine():
    assert strict_loads(' \n{"a": 1}\t ') == {"a": 1}


def test_no_coercion_and_nested_paths():
    error = code_of(decode_arguments, {"order_id": "o", "amount": "100", "items": [{"sku": 1}]}, SCHEMA)
    paths = [v["path"] for v in error.details["violations"]]
    assert paths == ["amount", "items[0].sku"]


def test_missing_required_field_names_the_field():
    error = code_of(decode_arguments, {"order_id": "o"}, SCHEMA)
    assert error.details["violations"] == [{"path": "amount", "keyword": "required",
                                            "message": "required field is missing"}]


def test_booleans_are_not_integers():
    error = code_of(decode_arguments, {"order_id": "o", "amount": True}, SCHEMA)
    assert error.code == "schema_violation"


def test_canonical_hash_ignores_key_order_and_whitespace():
    tool = load_registry([DEMO_REGISTRY]).resolve("refund_order")
    a = normalize(tool, strict_loads('{"order_id":"ord_1","amount":100,"reason":"x"}'))
    b = normalize(tool, strict_loads('{ "reason" : "x",\n "amount": 100, "order_id": "ord_1" }'))
    c = normalize(tool, strict_loads('{"order_id":"ord_1","amount":101,"reason":"x"}'))
    assert a.canonical == b.canonical == b'{"amount":100,"order_id":"ord_1","reason":"x"}'
    assert a.args_hash == b.args_hash != c.args_hash
    assert [r.id for r in a.resources] == ["order:ord_1"]
    assert a.resources[0].access == "exclusive"


def test_rfc8785_number_forms():
    assert canonical_json({"b": 1.0, "a": 1e21, "c": -0.0}) == b'{"a":1e+21,"b":1,"c":0}'


def test_integer_beyond_ieee_range_is_invalid_arguments():
    assert code_of(canonical_json, {"a": 2 ** 60}).code == "invalid_arguments"


def test_resource_ids_cannot_smuggle_separators():
    assert render_template("order:{order_id}", {"order_id": "a:b{c}"}) == "order:a%3Ab%7Bc%7D"
    assert render_template("order:{order_id}", {}) is None
    with pytest.raises(ProxyError):
        render_template("order:{order_id}", {"order_id": {"nested": 1}})
