"""``normalize.canonical_json`` writes plain values with orjson: the bytes must be ``rfc8785``'s on every
kind of value, and what the fast path does not take must still get ``rfc8785``'s answer or refusal."""

from __future__ import annotations

import random

import pytest
import rfc8785

from proxy.errors import ProxyError
from proxy.normalize import _plain, canonical_json

TEXTS = ["", "a", "ord_1001", "\"quoted\" \\ back", "\x00\x01\x1f\x7f", "\b\t\n\f\r", "é ü ß", "日本語",
         "\u2028\u2029", "😀 astral", "</script>", "a/b", "\ud7ff", "\ue000\uffff"]
KEYS = ["a", "B", "_", "z9", "", "id", "A", "aa", "é", "日本", "😀", "\ue000", "key with space"]


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["str", "int", "bool", "null", "float"] + (["list", "dict", "tuple"] if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return rng.choice(TEXTS) + "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 3)))
    if kind == "int":
        return rng.choice([0, 1, -1, 2**53 - 1, -(2**53 - 1), 2**53, -(2**53), 2**63, rng.randint(-10**6, 10**6)])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "float":
        return rng.choice([0.0, 1.0, 1.5, 1e21, 1e-7, -0.0, 0.1 + 0.2])
    items = [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    return {rng.choice(KEYS) + rng.choice(["", "x", "Z"]): item for item in items}


def reference(value):
    try:
        return rfc8785.dumps(value)
    except Exception as exc:  # noqa: BLE001 - the kind of refusal is what is compared
        return type(exc)


def ours(value):
    try:
        return canonical_json(value)
    except ProxyError as error:
        return error


def test_canonical_json_is_rfc8785_on_random_values():
    check_rfc8785_on_random_values(seed=8785, count=4000)  # tests/test_schema_fast_sweep.py: 20,000 more


def check_rfc8785_on_random_values(*, seed: int, count: int) -> None:
    rng = random.Random(seed)
    fast = 0
    for _ in range(count):
        value = random_value(rng)
        expected = reference(value)
        got = ours(value)
        if isinstance(expected, bytes):
            assert got == expected, value
        else:  # refused by rfc8785: refused here too, as invalid arguments
            assert isinstance(got, ProxyError) and got.code == "invalid_arguments", value
        fast += _plain(value)
    assert fast > count // 10  # the fast path was exercised, not only the fallback


@pytest.mark.parametrize("value", [
    {"b": 1, "a": [True, None, -5, 2**53 - 1], "c": {"z": "x", "y": ""}},
    "\ud800",                      # a lone surrogate: orjson refuses, rfc8785 decides
    {"é": 1, "e": 2, "😀": 3, "\ue000": 4},  # non-ASCII keys: rfc8785's UTF-16 order
    [1.0, 2.5, 1e21],              # floats: ECMAScript number text
    2**53,                         # beyond the exact integers
])
def test_edge_values_match_rfc8785(value):
    expected = reference(value)
    got = ours(value)
    if isinstance(expected, bytes):
        assert got == expected
    else:
        assert isinstance(got, ProxyError) and got.code == "invalid_arguments"


def test_subclasses_go_to_rfc8785():
    class Text(str):
        pass

    assert not _plain({"a": Text("x")}) and canonical_json({"a": Text("x")}) == rfc8785.dumps({"a": "x"})
