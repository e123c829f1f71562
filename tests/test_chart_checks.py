"""scripts/check-chart.sh: the checks platform and security teams run on the chart.

Runs the real script (helm, kubernetes-validate, the vendored CRD schemas,
checkov from .tools/chartcheck-venv) on deliberately broken inputs kept under
tests/chart_checks/ and asserts it fails with the expected finding; the
chart's own values sets pass (scripts/test.sh runs the script on them).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.helm import CHART
from tests.support.stack import REPO

SCRIPT = REPO / "scripts" / "check-chart.sh"
BROKEN = REPO / "tests" / "chart_checks"
TOOLS = REPO / ".tools" / "chartcheck-venv" / "bin"


def check_chart(*args: str) -> subprocess.CompletedProcess[str]:
    if not (TOOLS / "checkov").exists():
        pytest.fail("no .tools/chartcheck-venv: run scripts/setup.sh")
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def findings(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return re.findall(r"^FAIL \[(.+?)\] (.+?)  \(values", proc.stderr, re.M)


def test_kube_version_states_the_oldest_and_newest_supported_minor():
    kube_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    assert kube_version == ">=1.29.0-0 <1.38.0-0"
    readme = (CHART / "README.md").read_text()
    assert "Kubernetes 1.29 to 1.37" in readme


def test_a_checkov_finding_without_a_reasoned_skip_fails_the_check():
    proc = check_chart(str(BROKEN / "no-agent-probes-values.yaml"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = findings(proc)
    assert ("checkov CKV_K8S_8", "Deployment toolproxy-check/toolproxy-agent") in found, proc.stderr
    assert ("checkov CKV_K8S_9", "Deployment toolproxy-check/toolproxy-agent") in found, proc.stderr
    # The message says how to fix or skip it, next to the resource.
    assert 'checkov.io/skipN: "CKV_K8S_8=<why it does not apply>"' in proc.stderr


def test_a_resource_invalid_for_the_oldest_supported_kubernetes_fails_the_check():
    proc = check_chart(str(BROKEN / "newer-than-oldest-kube-values.yaml"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = findings(proc)
    assert found == [("kubernetes-validate --strict 1.29", "Deployment toolproxy-check/toolproxy-agent")], proc.stderr
    assert "appArmorProfile" in proc.stderr


@pytest.fixture
def chart_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "toolproxy"
    shutil.copytree(CHART, copy, symlinks=False)        # files/policies etc. are symlinks into the repo
    return copy


def test_a_custom_resource_the_vendored_crd_refuses_fails_the_check(chart_copy: Path):
    template = chart_copy / "templates" / "servicemonitor.yaml"
    text = template.read_text()
    assert "      path: /metrics\n" in text
    template.write_text(text.replace("      path: /metrics\n", "      metricsPath: /metrics\n", 1))
    proc = check_chart("--chart", str(chart_copy), str(CHART / "ci" / "production-values.yaml"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = findings(proc)
    assert ("CRD schema monitoring.coreos.com/v1 ServiceMonitor", "ServiceMonitor toolproxy-check/toolproxy") in found
    assert "metricsPath" in proc.stderr and "Additional properties are not allowed" in proc.stderr


def test_a_skip_without_a_reason_fails_the_check(chart_copy: Path):
    template = chart_copy / "templates" / "serviceaccount.yaml"
    text = template.read_text()
    template.write_text(text.replace("  labels:\n", "  annotations:\n    checkov.io/skip1: CKV_K8S_21\n  labels:\n", 1))
    proc = check_chart("--chart", str(chart_copy))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("checkov CKV_K8S_21", "ServiceAccount toolproxy-check/toolproxy") in findings(proc), proc.stderr
    assert "skipped without a reason" in proc.stderr
