"""Redaction without servers: masked fields, credential-like keys, truncation, log scrubbing (proxy/telemetry/redaction.py)."""

from __future__ import annotations

import pytest

from proxy.telemetry.redaction import MASK, MAX_ITEMS, looks_secret, redact, scrub


def test_sensitive_fields_and_credential_like_keys_are_masked_at_any_depth():
    arguments = {"reason": "private", "order_id": "ord_1",
                 "nested": {"api-key": "k", "ok": 1, "items": [{"Password": "p", "n": 2}]}}
    out = redact(arguments, ["reason"], 100)
    assert out == {"reason": MASK, "order_id": "ord_1",
                   "nested": {"api-key": MASK, "ok": 1, "items": [{"Password": MASK, "n": 2}]}}
    assert arguments["reason"] == "private"  # a copy, never the caller's object


def test_dotted_paths_cross_arrays_element_wise():
    out = redact({"lines": [{"card": "4111", "sku": "a"}, {"card": "5500", "sku": "b"}]}, ["lines.card"], 100)
    assert out == {"lines": [{"card": MASK, "sku": "a"}, {"card": MASK, "sku": "b"}]}


def test_long_strings_long_lists_and_deep_structures_are_truncated():
    assert redact("x" * 12, [], 5) == "xxxxx...[truncated: 12 chars]"
    out = redact(list(range(MAX_ITEMS + 3)), [], 10)
    assert len(out) == MAX_ITEMS + 1 and out[-1] == "[truncated: 3 more items]"
    deep: dict = {}
    node = deep
    for _ in range(12):
        node["d"] = {}
        node = node["d"]
    assert "[truncated: too deep]" in repr(redact(deep, [], 10))


def test_looks_secret_reads_dashes_as_underscores():
    assert looks_secret("X-Api-Key") and looks_secret("client_secret") and not looks_secret("order_id")


def test_scrub_removes_credentials_from_log_text():
    text = scrub('auth Bearer abc.def token=xyz "password": "hunter2" eyJhbGciOiJI.eyJzdWIiOiJh.sig')
    assert "abc.def" not in text and "xyz" not in text and "hunter2" not in text and "eyJ" not in text
    assert scrub("order ord_1 refunded") == "order ord_1 refunded"


def test_the_approvers_view_keeps_everything_and_hashes_each_masked_field():
    from proxy.telemetry.redaction import field_hash, reveal
    deep: dict = {"i": "bottom"}
    for name in "hgfedcba":
        deep = {name: deep}
    arguments = {"note": "x" * 5000, "items": list(range(120)), "deep": deep,
                 "card": {"number": "4111", "holder": "A"}, "api_token": "t0k"}
    key = b"k" * 32
    shown = reveal(arguments, ["card.number"], "apr_1", key=key)
    assert shown["note"] == arguments["note"] and shown["items"] == arguments["items"]
    assert shown["deep"] == arguments["deep"]  # no depth cut
    assert shown["card"] == {"number": field_hash("4111", "apr_1", key), "holder": "A"}
    assert shown["api_token"] == field_hash("t0k", "apr_1", key) != field_hash("t0k", "apr_2", key)  # per approval
    # keyed: without the key nobody can recompute it to test guesses of a low-entropy value
    assert field_hash("t0k", "apr_1", key) != field_hash("t0k", "apr_1", b"j" * 32)
    import hashlib
    assert hashlib.sha256(b'apr_1\n"4111"').hexdigest() not in repr(shown)
    with pytest.raises(ValueError):
        field_hash("t0k", "apr_1", b"")
    assert "4111" not in repr(shown) and "t0k" not in repr(shown)
    assert arguments["card"]["number"] == "4111"  # a copy
