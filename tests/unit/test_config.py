"""Configuration checks without servers: precedence, env parsing, refused values (proxy/config.py)."""

from __future__ import annotations

import pytest

from proxy.config import Config, ConfigError, describe, load_config, serving_problem


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


def test_opa_is_a_unix_socket_by_default_and_a_malformed_opa_url_is_refused():
    opa = load_config(env={}).opa
    assert opa.socket_path == "/var/run/toolproxy-opa/opa.sock" and opa.http_base == "http://localhost"
    tcp = load_config(env={"TOOLPROXY_OPA_URL": "http://127.0.0.1:8181/"}).opa
    assert tcp.socket_path is None and tcp.http_base == "http://127.0.0.1:8181"
    for bad in ("unix://relative.sock", "unix:/x.sock", "unix:///run/opa/", "ftp://opa:8181", "127.0.0.1:8181"):
        with pytest.raises(ConfigError, match="opa.url"):
            load_config(env={"TOOLPROXY_OPA_URL": bad})


KEYS = {"integrity.mac_key_file": "/secrets/mac.key", "call_tokens.signing_key_file": "/secrets/signing.pem"}


@pytest.mark.parametrize("missing", [["integrity.mac_key_file"], ["call_tokens.signing_key_file"],
                                     ["integrity.mac_key_file", "call_tokens.signing_key_file"]])
def test_run_refuses_a_process_without_both_fleet_keys_in_one_line_naming_both(missing):
    config = load_config(env={}, overrides={k: v for k, v in KEYS.items() if k not in missing})
    problem = serving_problem(config)
    assert problem is not None and "\n" not in problem
    assert problem.startswith(" and ".join(missing) + " not set")
    assert "integrity.mac_key_file" in problem and "call_tokens.signing_key_file" in problem
    assert "restart or a second replica" in problem


def test_run_refuses_opa_over_tcp_unless_the_escape_hatch_is_set():
    tcp = {**KEYS, "opa.url": "http://127.0.0.1:8181"}
    problem = serving_problem(load_config(env={}, overrides=tcp))
    assert problem is not None and problem.startswith("opa.url: http://127.0.0.1:8181 is TCP")
    assert "opa.allow_tcp=true" in problem and "unix://" in problem
    assert serving_problem(load_config(env={}, overrides={**tcp, "opa.allow_tcp": True})) is None
    assert serving_problem(load_config(env={}, overrides={**KEYS, "opa.url": "unix:///run/opa/opa.sock"})) is None
