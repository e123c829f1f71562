"""Registry loading/validation, check-registry CLI, and configuration."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proxy.cli import main as cli_main
from proxy.config import ConfigError, load_config
from tests.support.stack import DEMO_REGISTRY, REPO
from tests.unit.test_registry_rules import TOOL, write


def test_check_registry_cli(tmp_path, capsys):
    assert cli_main(["check-registry", str(DEMO_REGISTRY)]) == 0
    assert "ok refund_order 1.0.0 (write, financial, related read get_order@1.0.0, approvers read reason)" \
        in capsys.readouterr().out
    bad = write(tmp_path, TOOL.replace("mode: read", "mode: 7"))
    assert cli_main(["check-registry", str(bad)]) == 1
    assert "$.tools[0].mode" in capsys.readouterr().err


def test_run_refuses_a_bad_registry_before_listening(tmp_path):
    bad = write(tmp_path, TOOL.replace("additionalProperties: false, ", ""))
    result = subprocess.run([sys.executable, "-m", "proxy.cli", "run"], cwd=REPO, capture_output=True, text=True,
                            timeout=30, env={"TOOLPROXY_REGISTRY_PATHS": str(bad), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 1
    assert str(bad) in result.stderr and "Traceback" not in result.stderr


def test_env_overrides_file_and_types_are_checked(tmp_path):
    path = write(tmp_path, "listen: {port: 9000}\nopa: {timeout_ms: 100}\n", "config.yaml")
    config = load_config(path, env={"TOOLPROXY_LISTEN_PORT": "9100", "TOOLPROXY_BACKENDS_SERVICES": "demo=http://x:1",
                                    "TOOLPROXY_REGISTRY_PATHS": "a.yaml, b.yaml"})
    assert config.listen.port == 9100
    assert config.opa.timeout_ms == 100
    assert config.backends.services == {"demo": "http://x:1"}
    assert config.registry.paths == ["a.yaml", "b.yaml"]
    assert config.admin.port == 8788 and config.ops.port == 9464
    with pytest.raises(ConfigError, match="TOOLPROXY_LISTEN_PORT"):
        load_config(env={"TOOLPROXY_LISTEN_PORT": "eighty"})
    with pytest.raises(ConfigError, match="config.listen.port"):
        load_config(write(tmp_path, "listen: {port: '80'}\n", "c2.yaml"), env={})
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config(write(tmp_path, "listen: {prot: 80}\n", "c3.yaml"), env={})


# The configuration reference (docs/configuration.md) against proxy/config.py: tests/unit/test_docs.py.


def test_run_without_identity_keys_refuses_to_start():
    # The default identity mode is jwt: a sidecar nobody configured must not trust every caller.
    result = subprocess.run([sys.executable, "-m", "proxy.cli", "run"], cwd=REPO, capture_output=True, text=True,
                            timeout=30, env={"PATH": "/usr/bin:/bin",
                                             "TOOLPROXY_REGISTRY_PATHS": str(DEMO_REGISTRY)})
    assert result.returncode == 1
    assert "identity.mode is jwt" in result.stderr and "Traceback" not in result.stderr


def test_dev_defaults_yield_to_the_config_file(tmp_path):
    path = write(tmp_path, "identity: {mode: headers}\n", "dev.yaml")
    assert load_config(path, env={}, base={"identity.mode": "static"}).identity.mode == "headers"
    assert load_config(None, env={}, base={"identity.mode": "static"}).identity.mode == "static"
    assert load_config(None, env={}).identity.mode == "jwt"
