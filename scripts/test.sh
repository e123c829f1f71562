#!/usr/bin/env bash
# Run every check: setup, Rego (check, tests + coverage, policy check), Helm chart (lint,
# template, scripts/check-chart.sh: kubernetes-validate, CRD schemas, checkov), pytest.
# Extra arguments are passed to pytest. Exits non-zero if any step fails;
# all steps run even after an earlier one failed, pytest always runs last.
#
# scripts/test.sh --fast [PYTEST ARGS]: only the unit tests of tests/unit/ (pure modules, no OPA,
# no Redis, no processes; seconds). tests/conftest.py and its server fixtures are not loaded.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [[ "${1:-}" == "--fast" ]]; then
    shift
    [[ -x .venv/bin/python ]] || bash scripts/setup.sh
    # (pytest-aiohttp serves apps on sockets, which the unit tier never opens: not loaded, a third of a second.)
    exec .venv/bin/python -m pytest -q -p no:cacheprovider -p no:aiohttp --confcutdir tests/unit -m unit tests/unit "$@"
fi

bash scripts/setup.sh

export PATH="$ROOT/.venv/bin:$PATH"
PY="$ROOT/.venv/bin/python"
COVERAGE_MIN="${OPA_COVERAGE_MIN:-90}"
CHART="deploy/helm/toolproxy"
failed=()

step() { printf '\n==> %s\n' "$*"; }
run() {  # run NAME CMD...
    local name="$1"; shift
    if ! "$@"; then
        printf '!! step failed: %s\n' "$name" >&2
        failed+=("$name")
    fi
}

opa_coverage() {
    local report
    report="$(mktemp)"
    # opa exits non-zero when a test fails; still inspect the report.
    opa test policies/ --coverage > "$report" || true
    "$PY" - "$report" "$COVERAGE_MIN" <<'PY'
import json, sys
path, minimum = sys.argv[1], float(sys.argv[2])
try:
    report = json.load(open(path))
except ValueError as exc:
    print(f"could not parse 'opa test --coverage' output: {exc}")
    sys.exit(1)
# Gate on policy files only: OPA's overall figure also counts *_test.rego.
covered = uncovered = 0
for name, f in sorted(report.get("files", {}).items()):
    if name.endswith("_test.rego"):
        continue
    c, n = f.get("covered_lines", 0), f.get("not_covered_lines", 0)
    covered, uncovered = covered + c, uncovered + n
    rows = sorted({r for span in f.get("not_covered", [])
                   for r in range(span["start"]["row"], span["end"]["row"] + 1)})
    extra = f"  (not covered: lines {', '.join(map(str, rows))})" if rows else ""
    print(f"  {f.get('coverage', 0.0):6.2f}%  {name}{extra}")
lines = covered + uncovered
total = 100.0 * covered / lines if lines else 100.0
print(f"Rego coverage (policy files, excluding *_test.rego): {total:.2f}% "
      f"of {lines} lines (minimum {minimum:g}%)")
sys.exit(0 if total >= minimum else 1)
PY
    local rc=$?
    rm -f "$report"
    return $rc
}

if [[ -d policies ]]; then
    step "opa check --strict policies/"
    run "opa check" opa check --strict policies/
    if [[ -n "$(find policies -name '*_test.rego' -print -quit)" ]]; then
        step "opa test policies/"
        run "opa test" opa test policies/
        step "opa test policies/ --coverage (minimum ${COVERAGE_MIN}%)"
        run "opa coverage" opa_coverage
    else
        step "opa test: skipped (no *_test.rego files in policies/)"
    fi
    step "toolproxy policy check (opa check --strict, opa fmt, Rego typed by the registry, policy data vs registry; demo data)"
    run "policy check" "$ROOT/.venv/bin/toolproxy" policy check --policy policies/ --data examples/opa \
        --registry examples/registry
else
    step "opa: skipped (no policies/ directory)"
fi

if [[ -f "$CHART/Chart.yaml" ]]; then
    # Helm notes each symlink it follows (files/policies -> policies/, files/registry
    # -> examples/registry); that note is expected, not an error.
    # The helm built by setup.sh assumes Kubernetes v1.20 without a cluster, below
    # Chart.yaml's kubeVersion: render for the newest version the chart supports.
    KUBE_VERSION="$("$PY" -c 'import sys; sys.path.insert(0, "."); from tests.support.helm import newest_kube_version; print(newest_kube_version())')"
    quiet_helm() { helm "$@" --kube-version "$KUBE_VERSION" 2> >(grep -v 'found symbolic link in path' >&2); }
    step "helm lint $CHART (default values, then each $CHART/ci/*-values.yaml)"
    run "helm lint" quiet_helm lint "$CHART"
    for values in "$CHART"/ci/*-values.yaml; do
        [[ -e "$values" ]] || continue
        run "helm lint $(basename "$values")" quiet_helm lint "$CHART" -f "$values"
    done
    helm_template() {  # helm_template [ARGS...]: render, report the manifest count
        local out
        out="$(mktemp)"
        if quiet_helm template toolproxy "$CHART" "$@" > "$out"; then
            echo "rendered $(grep -c '^kind:' "$out") manifests${1:+ with $*}"
            rm -f "$out"
        else
            rm -f "$out"
            return 1
        fi
    }
    step "helm template $CHART (default values refused without Redis credentials, then each ci/*-values.yaml)"
    defaults_refuse_without_redis_credentials() {
        local err
        if err="$(helm template toolproxy "$CHART" --kube-version "$KUBE_VERSION" 2>&1 >/dev/null)"; then
            echo "helm template rendered the default values, which carry no Redis credentials" >&2
            return 1
        fi
        grep -q "proxy.redis: no credentials" <<<"$err" || { echo "unexpected error: $err" >&2; return 1; }
        echo "refused: proxy.redis: no credentials"
    }
    run "helm template" defaults_refuse_without_redis_credentials
    for values in "$CHART"/ci/*-values.yaml; do
        [[ -e "$values" ]] || continue
        run "helm template $(basename "$values")" helm_template -f "$values"
    done
    step "values.schema.json refuses a string where a port goes"
    schema_refuses_bad_port() {
        local err
        if err="$(helm template toolproxy "$CHART" --kube-version "$KUBE_VERSION" --set proxy.ports.admin=not-a-port 2>&1 >/dev/null)"; then
            echo "helm template accepted proxy.ports.admin=not-a-port" >&2
            return 1
        fi
        grep -q "/proxy/ports/admin" <<<"$err" || { echo "unexpected error: $err" >&2; return 1; }
        echo "refused: $(grep -m1 "/proxy/ports/admin" <<<"$err" | sed 's/^ *//')"
    }
    run "helm schema" schema_refuses_bad_port
    step "scripts/check-chart.sh: kubernetes-validate --strict, CRD schemas, checkov (default values, each ci/*-values.yaml)"
    run "check-chart" bash scripts/check-chart.sh
else
    step "helm: skipped (no $CHART/Chart.yaml)"
fi

if ((${#failed[@]})); then
    printf '\n!! failed before pytest: %s\n' "${failed[*]}" >&2
fi

step "pytest"
pytest_rc=0
"$PY" -m pytest -q "$@" || pytest_rc=$?

if ((${#failed[@]})); then
    printf '!! also failed: %s\n' "${failed[*]}" >&2
    exit 1
fi
exit "$pytest_rc"
