"""The chart as a newcomer uses it: the documented `helm template` works as printed, a typo in
``proxy.config`` or in a registry file is refused at render with its path, and ``opa.data.document`` takes a
file's text (``--set-file``). Real helm (scripts/setup.sh's)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.authoring.devstack import find_binary

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "toolproxy"
MINIMAL = ["-f", str(CHART / "ci" / "minimal-values.yaml"), "--kube-version", "1.33.0"]


def helm_template(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([find_binary("helm"), "template", "t", str(CHART), *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def errors(done: subprocess.CompletedProcess[str]) -> str:
    return "\n".join(line for line in done.stderr.splitlines() if "walk.go" not in line)


def test_the_readmes_helm_template_works_as_printed():
    block = re.search(r"```sh\n(.*?)```", (CHART / "README.md").read_text(), flags=re.S)[1]
    [command] = [line for line in block.splitlines() if line.startswith("helm template")]
    argv = shlex.split(command.split("|")[0])
    done = subprocess.run([find_binary("helm"), *argv[1:]], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, errors(done)
    assert "kind: Deployment" in done.stdout


@pytest.mark.parametrize("setting, said", [
    ("proxy.config.identity.mode=jwtt", "at '/proxy/config/identity/mode': value must be one of 'jwt', 'headers', 'static'"),
    ("proxy.config.idenity.mode=jwt", "at '/proxy/config': additional properties 'idenity' not allowed"),
    ("proxy.config.audit.sinks={stdot}", "at '/proxy/config/audit/sinks/0': value must be one of 'stdout', 'redis'"),
    ("proxy.config.listen.max_body_bytes=big", "at '/proxy/config/listen/max_body_bytes'"),
])
def test_a_typo_in_proxy_config_is_refused_at_render(setting, said):
    done = helm_template(*MINIMAL, "--set", setting)
    assert done.returncode != 0 and said in errors(done), errors(done)


def test_a_registry_file_with_a_bad_mode_is_refused_at_render(tmp_path):
    registry = tmp_path / "vouchers.yaml"
    registry.write_text('tools:\n  - name: issue_voucher\n    version: "1.0.0"\n    description: Give a voucher.\n'
                        '    mode: writ\n    risk: write\n    inputSchema: {type: object}\n'
                        '    backend: {type: http, url: "http://vouchers:8080/v"}\n')
    done = helm_template(*MINIMAL, "--set-file", f"registry.files.vouchers\\.yaml={registry}")
    assert done.returncode != 0
    assert "registry.files[vouchers.yaml]: tools[0] (issue_voucher): mode writ is not read or write" in errors(done)
    registry.write_text(registry.read_text().replace("mode: writ", "mode: write"))
    assert helm_template(*MINIMAL, "--set-file", f"registry.files.vouchers\\.yaml={registry}").returncode == 0


def test_opa_data_document_takes_a_files_text(tmp_path):
    data = tmp_path / "data.json"
    data.write_text('{"toolproxy": {"meta": {"revision": "from-a-file"}}}')
    done = helm_template(*MINIMAL, "--set-file", f"opa.data.document={data}")
    assert done.returncode == 0, errors(done)
    assert "from-a-file" in done.stdout
    data.write_text("{not json: [")
    bad = helm_template(*MINIMAL, "--set-file", f"opa.data.document={data}")
    assert bad.returncode != 0 and "opa.data.document: not a JSON or YAML object" in errors(bad)


def test_the_charts_config_schema_is_the_typed_configs():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "chart_config_schema.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
