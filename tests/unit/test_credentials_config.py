"""The ``credentials`` section: each kind's needs checked at load, one line naming the setting and the fix."""

from __future__ import annotations

import pytest

from proxy.config import ConfigError, load_config


def load(credentials, **more):
    return load_config(env={}, overrides={"credentials": credentials, **more})


@pytest.mark.parametrize("entry, message", [
    ({"kind": "bearer"}, r"credentials.k.secret_file: kind bearer needs it"),
    ({"kind": "header", "secret_file": "/x"}, r"credentials.k.header: kind header needs it"),
    ({"kind": "basic", "secret_file": "/x"}, r"credentials.k.username: kind basic needs it"),
    ({"kind": "magic"}, r"credentials.k.kind .*'magic' is not allowed"),
    ({"kind": "bearer", "secret_file": "/x", "colour": "red"}, r"credentials.k: unknown setting\(s\) colour"),
    ({"kind": "client_credentials", "token_url": "http://auth.example.com/token", "client_id": "c",
      "client_secret_file": "/x"}, r"token_url: plain http sends the client's secret in clear"),
    ({"kind": "client_credentials", "token_url": "https://auth.example.com/token", "client_id": "c"},
     r"client_secret_file: client_auth client_secret_basic needs it"),
    ({"kind": "client_credentials", "token_url": "https://a/token", "client_id": "c",
      "client_auth": "private_key_jwt"}, r"private_key_file: client_auth private_key_jwt needs it"),
    ({"kind": "tls", "tls_cert_file": "/c"}, r"tls_cert_file and tls_key_file go together"),
    ({"kind": "tls"}, r"kind tls needs"),
    ({"kind": "header", "header": "Bad Header", "secret_file": "/x"}, r"header: 'Bad Header' is not an HTTP header"),
])
def test_each_kind_names_what_it_lacks(entry, message):
    with pytest.raises(ConfigError, match=message):
        load({"k": entry})


def test_token_exchange_needs_the_callers_verified_token():
    entry = {"kind": "token_exchange", "token_url": "https://a/token", "client_id": "c", "client_secret_file": "/x"}
    with pytest.raises(ConfigError, match=r"credentials.k: kind token_exchange .* only identity.mode jwt"):
        load({"k": entry}, **{"identity.mode": "static"})
    assert load({"k": entry}).credentials["k"].kind == "token_exchange"  # jwt: the default mode


def test_credentials_come_from_yaml_or_json_in_the_environment(tmp_path):
    config = load_config(env={"TOOLPROXY_CREDENTIALS": '{"saas": {"kind": "bearer", "secret_file": "/run/key"}}'})
    assert config.credentials["saas"].secret_file == "/run/key"
    with pytest.raises(ConfigError, match="TOOLPROXY_CREDENTIALS"):
        load_config(env={"TOOLPROXY_CREDENTIALS": "[1, 2]"})
    with pytest.raises(ConfigError, match=r"credentials: 'a b' is not a name"):
        load({"a b": {"kind": "tls", "tls_ca_file": "/ca"}})


def test_a_secret_never_appears_in_the_configs_repr(tmp_path):
    config = load({"k": {"kind": "bearer", "secret_file": str(tmp_path / "key")}})
    assert "secret_file" in repr(config.credentials["k"])  # a path, not the secret: the secret is read later
