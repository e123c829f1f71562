#!/usr/bin/env bash
# Run every check: setup, Rego (check, tests + coverage), Helm chart, pytest.
# Extra arguments are passed to pytest. Exits non-zero if any step fails;
# all steps run even after an earlier one failed, pytest always runs last.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

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
else
    step "opa: skipped (no policies/ directory)"
fi

if [[ -f "$CHART/Chart.yaml" ]]; then
    step "helm lint $CHART"
    run "helm lint" helm lint "$CHART"
    step "helm template $CHART"
    helm_template() {
        local out
        out="$(mktemp)"
        if helm template toolproxy "$CHART" > "$out"; then
            echo "rendered $(grep -c '^kind:' "$out") manifests"
            rm -f "$out"
        else
            rm -f "$out"
            return 1
        fi
    }
    run "helm template" helm_template
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
