"""Configuration checks without servers: precedence, env parsing, refused values (proxy/config.py)."""

from __future__ import annotations

import pytest

from proxy.config import Config, ConfigError, describe, load_config


def test_defaults_then_base_then_file_then_env_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("idempotency:\n  max_wait_ms: 1000\nlocks:\n  lease_ms: 9000\n")
    config = load_config(path, env={"TOOLPROXY_IDEMPOTENCY_MAX_WAIT_MS": "2000"},
                         overrides={"opa.url": "http://opa.test:8181"},
                         base={"idempotency.max_wait_ms": 10, "locks.lease_ms": 1})
    assert config.idempotency.max_wait_ms == 2000  # env over file over base
    assert config.locks.lease_ms == 9000  # file over base
    assert config.opa.url == "http://opa.test:8181"
    assert load_config(env={}).idempotency.max_wait_ms == Config().idempotency.max_wait_ms


@pytest.mark.parametrize("env", [
    {"TOOLPROXY_IDEMPOTENCY_MAX_WAIT_MS": "soon"},
    {"TOOLPROXY_RECONCILE_ENABLED": "maybe"},
])
def test_a_badly_typed_environment_value_is_refused_naming_the_variable(env):
    with pytest.raises(ConfigError) as caught:
        load_config(env=env)
    assert next(iter(env)) in str(caught.value)


def test_a_file_that_is_not_a_mapping_or_names_an_unknown_key_is_refused(tmp_path):
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listing, env={})
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("idempotency:\n  max_wiat_ms: 5\n")
    with pytest.raises(ConfigError, match="max_wiat_ms"):
        load_config(unknown, env={})


def test_every_setting_has_help_and_an_environment_name():
    rows = list(describe())
    assert len(rows) > 50
    for key, env, _default, help_text in rows:
        assert help_text, key
        assert env == "TOOLPROXY_" + key.replace(".", "_").upper()
