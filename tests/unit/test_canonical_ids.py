"""Canonical forms of resource ids, in isolation: time notations and alias tables (proxy/canonical_ids.py)."""

from __future__ import annotations

import json

import pytest

from proxy.canonical_ids import MAX_ALIAS_FILE_BYTES, FormError, canonical_time, form_from_registry
from proxy.errors import ProxyError

NINE_UTC = "2026-12-02T09:00:00Z"


@pytest.mark.parametrize("spelling", [
    "2026-12-02T09:00:00Z", "2026-12-02T10:00:00+01:00", "2026-12-02T04:00:00-05:00", "2026-12-02 09:00:00Z",
    "20261202T090000Z", "2026-12-02t09:00:00z", "2026-12-02T09:00Z", "2026-12-02T09:00:00.000Z",
    "2026-12-02T09:00:00+00:00", "2026-W49-3T09:00:00Z", "2026-12-02T10:00:00+0100",
])
def test_every_notation_of_one_instant_is_one_utc_text(spelling):
    assert canonical_time("at", spelling, "instant") == NINE_UTC


def test_an_instant_keeps_a_fraction_that_is_not_zero_and_crosses_a_day_to_utc():
    assert canonical_time("at", "2026-12-02T09:00:00.250+00:00", "instant") == "2026-12-02T09:00:00.25Z"
    assert canonical_time("at", "2026-12-02T01:30:00+03:00", "instant") == "2026-12-01T22:30:00Z"


@pytest.mark.parametrize("value", ["2026-12-02T09:00:00", "2026-12-02", "yesterday", "", "2026-13-02T09:00:00Z",
                                   "2026-12-02T09:00:00Z" + " " * 64, "0001-01-01T00:00:00+01:00"])
def test_an_instant_without_an_offset_or_in_no_notation_is_refused_naming_the_argument(value):
    with pytest.raises(ProxyError) as info:
        canonical_time("at", value, "instant")
    assert info.value.code == "invalid_arguments" and info.value.details == {"path": "at"}


@pytest.mark.parametrize("spelling", ["2026-12-02", "20261202", "2026-W49-3"])
def test_every_notation_of_one_date_is_one_text(spelling):
    assert canonical_time("day", spelling, "date") == "2026-12-02"


def test_a_date_form_refuses_a_time_of_day():
    with pytest.raises(ProxyError):
        canonical_time("day", "2026-12-02T00:00:00Z", "date")


def test_aliases_are_looked_up_in_the_normalized_spelling_and_name_the_canonical_value(tmp_path):
    form = form_from_registry({"case": "fold", "aliases": {"ACME Corp": "acme", "Acme Inc.": "ACME"},
                               "pattern": "[a-z]+"}, tmp_path)
    assert form.aliases == (("acme corp", "acme"), ("acme inc.", "acme"))  # targets in the form too
    assert [form.apply("org", v) for v in ("acme corp", "ACME CORP", "Acme", "acme inc.")] == ["acme"] * 4
    assert form.apply("org", ["Acme Corp", "globex"]) == ["acme", "globex"]
    with pytest.raises(ProxyError):
        form.apply("org", "Unknown Corp")  # not an alias, and not in the pattern


def test_an_alias_may_name_a_time_and_a_file_adds_aliases(tmp_path):
    (tmp_path / "days.json").write_text(json.dumps({"launch": "2026-12-02T10:00:00+01:00"}))
    form = form_from_registry({"time": "instant", "aliases_file": "days.json"}, tmp_path)
    assert form.apply("at", "launch") == NINE_UTC and form.apply("at", "20261202T090000Z") == NINE_UTC
    assert form.aliases_file == str((tmp_path / "days.json").resolve())


@pytest.mark.parametrize("raw, file_text, what", [
    ({"aliases": {"a": "b", "b": "c"}}, None, "both an alias and the target"),
    ({"case": "lower", "aliases": {"X": "one", "x": "two"}}, None, "names two objects"),
    ({"time": "date", "aliases": {"launch": "soon"}}, None, "has no canonical form"),
    ({"aliases_file": "missing.json"}, None, "cannot read"),
    ({"aliases_file": "t.json"}, '{"a": "b", "a": "c"}', "appears twice"),
    ({"aliases_file": "t.json"}, '["a"]', "one JSON object"),
    ({"aliases_file": "t.json"}, '{"a": 1}', "one JSON object"),
    ({"aliases_file": "t.json", "aliases": {"a": "b"}}, '{"a": "c"}', "also names"),
])
def test_an_alias_table_that_cannot_name_one_object_is_refused(tmp_path, raw, file_text, what):
    if file_text is not None:
        (tmp_path / "t.json").write_text(file_text)
    with pytest.raises(FormError, match=what):
        form_from_registry(raw, tmp_path)


def test_an_oversized_alias_file_is_refused_unread(tmp_path):
    (tmp_path / "t.json").write_bytes(b" " * (MAX_ALIAS_FILE_BYTES + 1))
    with pytest.raises(FormError, match="larger than") as info:
        form_from_registry({"aliases_file": "t.json"}, tmp_path)
    assert info.value.where == "aliases_file"
