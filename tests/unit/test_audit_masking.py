"""What an audit record may show of a call's arguments, and the audit settings the loader refuses
(pure code, no sink; the sinks themselves are tests/test_audit.py)."""

from __future__ import annotations

import pytest

from proxy.telemetry.redaction import MASK, redact


def test_sensitive_fields_are_masked_at_any_depth_and_across_arrays():
    args = {"name": "x", "card": {"number": "4111", "exp": "12/30"},
            "items": [{"secret_note": "a", "sku": "s1"}, {"pin": "1234", "sku": "s2"}]}
    out = redact(args, ["card.number", "items.pin", "name"], 100)
    assert out == {"name": MASK, "card": {"number": MASK, "exp": "12/30"},
                   "items": [{"secret_note": MASK, "sku": "s1"}, {"pin": MASK, "sku": "s2"}]}
    assert args["card"]["number"] == "4111"  # a copy: the call's arguments are untouched


def test_credential_looking_keys_are_masked_even_when_the_contract_forgot():
    out = redact({"Password": "p", "api-key": "k", "accessToken": "t", "Cookie": "c", "note": "n"}, [], 100)
    assert out == {"Password": MASK, "api-key": MASK, "accessToken": MASK, "Cookie": MASK, "note": "n"}


def test_long_strings_and_long_arrays_are_truncated():
    out = redact({"body": "x" * 1000, "list": list(range(60))}, [], 10)
    assert out["body"] == "x" * 10 + "...[truncated: 1000 chars]"
    assert len(out["list"]) == 51 and out["list"][-1] == "[truncated: 10 more items]"


def test_an_invalid_failure_policy_or_sink_is_a_config_error():
    from proxy.config import ConfigError, load_config
    # The config loader refuses them (one place for every enumerated setting), naming key, value and choices.
    with pytest.raises(ConfigError, match="audit.on_failure_write .*'maybe'.*fail_closed, fail_open"):
        load_config(env={}, overrides={"audit.on_failure_write": "maybe"})
    with pytest.raises(ConfigError, match="audit.sinks .*'kafka'.*stdout, redis"):
        load_config(env={}, overrides={"audit.sinks": ["kafka"]})
    from proxy.audit import check_config
    with pytest.raises(ConfigError, match="audit.sinks.*at least one"):
        check_config(load_config(env={"TOOLPROXY_AUDIT_SINKS": ""}).audit)
