"""What records keep of a call's arguments (proxy/telemetry/record_view.py), in isolation: values the
contract shows in clear, a keyed fingerprint of every other value at any depth, one fingerprint per value."""

from __future__ import annotations

import hashlib
import hmac
import json

from proxy.telemetry.record_view import apply, ephemeral_key, fingerprint, view_from_schema

KEY = ephemeral_key()
MAIL = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "to": {"type": "string"},
        "priority": {"enum": ["low", "high"]},
        "message": {"type": "object", "additionalProperties": False, "properties": {
            "subject": {"type": "string"}, "body": {"type": "string"}, "lines": {"type": "integer"}}},
        "attachments": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "size": {"type": "integer"}, "api_token": {"type": "string"}}}},
        "tags": {"type": "array", "items": {"type": "string"}},
        "extra": {"type": "object"},
        "note": {"type": ["string", "null"]},
    },
}
CALL = {"to": "mallory@evil.example", "priority": "high",
        "message": {"subject": "Hi", "body": "Your code is 884421", "lines": 3},
        "attachments": [{"name": "a.txt", "size": 10, "api_token": "t-1"}, {"name": "b.txt", "size": 20}],
        "tags": ["x", "884421"], "extra": {"free": "form"}, "note": None}


def test_text_is_fingerprinted_at_any_depth_and_numbers_enums_and_structure_stay():
    kept, masked = apply(CALL, view_from_schema(MAIL, shown=["to"]), KEY)
    assert kept == {
        "to": "mallory@evil.example", "priority": "high",  # a resource's name, an enum
        "message": {"subject": fingerprint("Hi", KEY), "body": fingerprint("Your code is 884421", KEY), "lines": 3},
        "attachments": [{"name": fingerprint("a.txt", KEY), "size": 10, "api_token": fingerprint("t-1", KEY)},
                        {"name": fingerprint("b.txt", KEY), "size": 20}],
        "tags": [fingerprint("x", KEY), fingerprint("884421", KEY)],
        "extra": fingerprint({"free": "form"}, KEY),  # an object the schema does not describe: one value
        "note": None,
    }
    assert ("message", "body") in masked and ("attachments", 1, "name") in masked and ("extra",) in masked
    assert "884421" not in repr(kept)
    assert CALL["message"]["body"] == "Your code is 884421"  # a copy


def test_one_value_has_one_fingerprint_wherever_it_stands_and_another_key_gives_another():
    kept, _ = apply({"tags": ["884421"], "message": {"body": "884421"}}, view_from_schema(MAIL), KEY)
    assert kept["tags"][0] == kept["message"]["body"] == fingerprint("884421", KEY)
    assert kept["tags"][0].startswith("hmac:") and len(kept["tags"][0]) == len("hmac:") + 16
    assert fingerprint("884421", ephemeral_key()) != fingerprint("884421", KEY)
    assert fingerprint(884421, KEY) != fingerprint("884421", KEY)


def test_safe_to_show_paths_keep_text_in_clear_and_sensitive_paths_and_credentials_stay_hidden():
    view = view_from_schema(MAIL, shown=["message", "attachments.name"], hidden=["message.body"])
    kept, masked = apply(CALL, view, KEY)
    assert kept["message"] == {"subject": "Hi", "body": fingerprint("Your code is 884421", KEY), "lines": 3}
    assert [a["name"] for a in kept["attachments"]] == ["a.txt", "b.txt"]
    assert kept["attachments"][0]["api_token"] == fingerprint("t-1", KEY)  # looks like a credential
    assert kept["to"] == fingerprint("mallory@evil.example", KEY)  # not shown this time
    assert sorted(masked, key=repr) == sorted([("to",), ("message", "body"), ("attachments", 0, "api_token"),
                                               ("tags", 0), ("tags", 1), ("extra",)], key=repr)


def test_a_sensitive_number_is_hidden_and_an_undeclared_name_keeps_its_name_not_its_value():
    schema = {"type": "object", "properties": {"pin": {"type": "integer"}, "amount": {"type": "integer"}}}
    kept, masked = apply({"pin": 1234, "amount": 5, "stray": "s"}, view_from_schema(schema, hidden=["pin"]), KEY)
    assert kept == {"pin": fingerprint(1234, KEY), "amount": 5, "stray": fingerprint("s", KEY)}
    assert masked == [("pin",), ("stray",)]


def test_audit_bounds_cut_only_what_is_kept_in_clear():
    schema = {"type": "object", "properties": {"text": {"type": "string"}, "ids": {"type": "array",
                                                                                  "items": {"type": "integer"}}}}
    view = view_from_schema(schema, shown=["text"])
    kept, _ = apply({"text": "x" * 100, "ids": list(range(60))}, view, KEY, max_chars=10, max_items=50)
    assert kept["text"] == "x" * 10 + "...[truncated: 100 chars]"
    assert len(kept["ids"]) == 51 and kept["ids"][-1] == "[truncated: 10 more items]"
    hidden, _ = apply({"text": "x" * 100}, view_from_schema(schema), KEY, max_chars=10)
    assert hidden["text"] == fingerprint("x" * 100, KEY)  # the whole value's fingerprint, not a cut one's


def test_a_schema_without_properties_keeps_the_argument_names():
    kept, masked = apply({"a": "x", "b": 2}, view_from_schema({"type": "object"}), KEY)
    assert kept == {"a": fingerprint("x", KEY), "b": fingerprint(2, KEY)} and masked == [("a",), ("b",)]


def test_a_fingerprint_is_the_hmac_of_the_values_sorted_key_json_whatever_path_computes_it():
    # every sidecar sharing the key must fingerprint a value alike, across versions: pinned to the definition
    def defined(value):
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        return "hmac:" + hmac.new(KEY, text.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:16]

    values = ["", "k1", 'say "hi"\\n\t', "naïve café ☕ 𝄞", "\ud800 lone surrogate", "\x00\x1f\x7f", "</script>",
              {"b": 1, "a": ["x", 2.5, None, True]}, [1, "two"], 3, -0.5, True, None]
    assert [fingerprint(v, KEY) for v in values] == [defined(v) for v in values]
    assert fingerprint("k1", KEY) != fingerprint("k2", KEY) and fingerprint("k1", KEY).startswith("hmac:")
