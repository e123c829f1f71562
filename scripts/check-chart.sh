#!/usr/bin/env bash
# Check the rendered Helm chart the way platform and security teams do:
# kubernetes-validate --strict (oldest and newest Kubernetes minor in Chart.yaml's
# kubeVersion), the vendored CRD schemas for custom resources, and
# checkov --framework kubernetes. Renders each
# deploy/helm/toolproxy/ci/*-values.yaml, or only the values files given:
#
#   scripts/check-chart.sh                      # what scripts/test.sh runs
#   scripts/check-chart.sh my-values.yaml       # one values set
#
# Exits non-zero with one "FAIL [check] resource" block per finding.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_PY="$ROOT/.tools/chartcheck-venv/bin/python"
if [[ ! -x "$TOOLS_PY" ]]; then
    echo "check-chart: no tools venv at $ROOT/.tools/chartcheck-venv (run scripts/setup.sh)" >&2
    exit 2
fi
exec "$TOOLS_PY" "$ROOT/scripts/check_chart.py" "$@"
