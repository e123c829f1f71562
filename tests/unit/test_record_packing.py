"""The operation record's packed form (proxy/operations.py): what ``pack_record`` writes, ``unpack_record``
reads back, byte for byte as Redis' ``cmsgpack`` packs a Lua table of strings."""

from __future__ import annotations

import pytest

from proxy.operations import FIELDS, LONG_NAMES, pack_record, unpack_record


def test_every_string_size_round_trips():
    fields = {"state": "SUCCEEDED", "outcome": "x" * 31, "meta": "é" * 40, "evidence": "y" * 300,
              "compensation": "z" * 70000, "cancel": ""}
    unpacked = unpack_record(pack_record(fields))
    assert {LONG_NAMES[k]: v for k, v in unpacked.items()} == fields


def test_more_than_fifteen_fields_use_a_map16_header():
    fields = {name: str(i) for i, name in enumerate(FIELDS)}
    assert len(fields) > 15
    packed = pack_record(fields)
    assert packed[0] == 0xDE
    assert {LONG_NAMES[k]: v for k, v in unpack_record(packed).items()} == fields


def test_the_short_names_are_unique_and_short():
    assert len(set(FIELDS.values())) == len(FIELDS) and all(len(v) <= 2 for v in FIELDS.values())


def test_a_value_that_is_not_a_map_of_strings_is_refused():
    with pytest.raises(ValueError):
        unpack_record(b"\x81\xa1s\xcc\x01")  # a uint8 value


def test_the_answer_bounds_must_fit_under_the_record_bound():
    from proxy.operations import MAX_RECORD_BYTES, answer_bound_problem
    assert answer_bound_problem(16 * 1024 * 1024) is None  # the defaults fit
    problem = answer_bound_problem(MAX_RECORD_BYTES // 2)
    assert problem is not None and "mcp.upstream_max_answer_bytes" in problem and "\n" not in problem
