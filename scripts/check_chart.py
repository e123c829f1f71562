"""Check the rendered Helm chart the way platform and security teams do.

Owns: rendering the chart (`helm template`) for each values set and for the
oldest and newest Kubernetes minor versions Chart.yaml's `kubeVersion` claims;
validating every resource (`kubernetes-validate --strict` for built-in kinds,
the vendored CRDs in deploy/crd-schemas/ for custom resources); scanning the
renders with `checkov --framework kubernetes`; printing each finding with what
to do about it. Exit status 0 only when everything passes.
Must never: skip a checkov check globally (skips live next to the resource, as
`checkov.io/skipN: CKV_…=<reason>` annotations, and a skip without a reason is
a finding), or pass a resource it had no schema for.

Runs with the chart-check tools venv (.tools/chartcheck-venv, made by
scripts/setup.sh); scripts/check-chart.sh is the entry point.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "toolproxy"
CRD_DIRS = [REPO / "deploy" / "crd-schemas" / "prometheus-operator-v0.85.0"]
RELEASE, NAMESPACE = "toolproxy", "toolproxy-check"   # a real install goes to a namespace of its own


@dataclass(frozen=True)
class Finding:
    values: str          # which values set rendered it
    check: str           # "kubernetes-validate 1.28", "checkov CKV_K8S_8", ...
    resource: str        # "Deployment toolproxy-check/toolproxy-agent"
    message: str
    hint: str


def supported_minors(chart: Path) -> tuple[str, str]:
    """(oldest, newest) "1.N" from kubeVersion ">=1.A.0-0 <1.B.0-0": 1.A and 1.(B-1)."""
    kube_version = str(yaml.safe_load((chart / "Chart.yaml").read_text()).get("kubeVersion", ""))
    low = re.search(r">=\s*v?1\.(\d+)", kube_version)
    high = re.search(r"<\s*v?1\.(\d+)", kube_version)
    if not (low and high):
        sys.exit(f"check-chart: {chart}/Chart.yaml kubeVersion {kube_version!r} must state both bounds, "
                 "e.g. \">=1.28.0-0 <1.38.0-0\" (oldest and newest supported minor)")
    return f"1.{low.group(1)}", f"1.{int(high.group(1)) - 1}"


def helm_binary() -> str:
    for candidate in (REPO / ".venv" / "bin" / "helm", shutil.which("helm")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    sys.exit("check-chart: no helm (run scripts/setup.sh)")


def render(chart: Path, values: Path | None, kube: str) -> str:
    args = [helm_binary(), "template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", f"{kube}.0"]
    if values:
        args += ["-f", str(values)]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        notes = "\n".join(line for line in proc.stderr.splitlines() if "found symbolic link" not in line)
        raise RenderError(notes.strip())
    return proc.stdout


class RenderError(Exception):
    """`helm template` refused the chart with these values (message: helm's)."""


def describe(doc: dict[str, Any]) -> str:
    meta = doc.get("metadata") or {}
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{doc.get('kind', '?')} {where}{meta.get('name', '?')}"


def load_crds() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> JSON schema of that served version, unknown fields refused."""
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for directory in CRD_DIRS:
        for path in sorted(directory.glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            spec = crd["spec"]
            for version in spec["versions"]:
                schema = strict_schema(version["schema"]["openAPIV3Schema"])
                schemas[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = schema
    return schemas


def strict_schema(node: Any) -> Any:
    """OpenAPI v3 structural schema -> JSON Schema that refuses unknown fields
    (the API server prunes them; `kubectl --validate=strict` refuses them) and
    admits null where the CRD says `nullable`."""
    if isinstance(node, list):
        return [strict_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: strict_schema(value) for key, value in node.items()}
    if (out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def validate_resources(values: str, docs: list[dict[str, Any]], kube: str,
                       crds: dict[tuple[str, str], dict[str, Any]]) -> Iterator[Finding]:
    for doc in docs:
        key = (doc.get("apiVersion", ""), doc.get("kind", ""))
        if key in crds:
            validator = jsonschema.Draft7Validator(crds[key])
            for error in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
                path = ".".join(str(p) for p in error.absolute_path) or "(root)"
                yield Finding(values, f"CRD schema {key[0]} {key[1]}", describe(doc), f"{path}: {error.message}",
                              "the vendored CRD (deploy/crd-schemas/) does not admit this field or value")
            continue
        try:
            kubernetes_validate.validate(doc, kube, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            yield Finding(values, f"kubernetes-validate {kube}", describe(doc),
                          f"no schema for {key[0]} {key[1]} in Kubernetes {kube}",
                          "a kind the oldest supported version lacks, or a custom resource whose CRD is not "
                          "vendored in deploy/crd-schemas/ (see its README)")
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.absolute_path) or "(root)"   # a jsonschema error
            yield Finding(values, f"kubernetes-validate --strict {kube}", describe(doc), f"{path}: {exc.message}",
                          "not a valid field/value for this Kubernetes version")


def checkov(tools_bin: Path, render_dir: Path, labels: dict[str, str]) -> Iterator[Finding]:
    proc = subprocess.run([str(tools_bin / "checkov"), "--framework", "kubernetes", "-d", str(render_dir),
                           "-o", "json", "--compact", "--skip-download"],
                          capture_output=True, text=True)
    try:
        reports = json.loads(proc.stdout)
    except ValueError:
        sys.exit(f"check-chart: checkov gave no JSON report (exit {proc.returncode}):\n"
                 f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    for report in reports if isinstance(reports, list) else [reports]:
        results = report.get("results") or {}
        for failed in results.get("failed_checks", []):
            yield Finding(labels.get(Path(failed["file_path"]).name, failed["file_path"]),
                          f"checkov {failed['check_id']}", checkov_resource(failed["resource"]),
                          failed["check_name"] + (f" (guide: {failed['guideline']})" if failed.get("guideline") else ""),
                          "fix it in the chart, or, if it does not apply, add to that resource's "
                          f"metadata.annotations: checkov.io/skipN: \"{failed['check_id']}=<why it does not apply>\"")
        for skipped in results.get("skipped_checks", []):
            reason = (skipped.get("check_result") or {}).get("suppress_comment", "").strip()
            if not reason or reason == "No comment provided":
                yield Finding(labels.get(Path(skipped["file_path"]).name, skipped["file_path"]),
                              f"checkov {skipped['check_id']}", checkov_resource(skipped["resource"]),
                              "skipped without a reason", f"write the skip as \"{skipped['check_id']}=<reason>\"")


def checkov_resource(resource: str) -> str:
    kind, _, rest = resource.partition(".")       # "Deployment.toolproxy-check.toolproxy-agent"
    namespace, _, name = rest.partition(".")
    return f"{kind} {namespace}/{name}" if name else resource


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("values", nargs="*", type=Path,
                        help="values files, each checked on its own (default: ci/*-values.yaml; ci/minimal-values.yaml is "
                             "the defaults plus the Redis credentials every release needs)")
    parser.add_argument("--chart", type=Path, default=CHART)
    args = parser.parse_args()

    tools_bin = Path(sys.executable).parent
    oldest, newest = supported_minors(args.chart)
    sets: list[tuple[str, Path | None]] = (
        [(str(v), v) for v in args.values] if args.values
        # The defaults alone do not render (no Redis credentials): ci/minimal-values.yaml is defaults + those.
        else [(f"ci/{v.name}", v) for v in sorted((args.chart / "ci").glob("*-values.yaml"))])
    crds = load_crds()
    findings: list[Finding] = []
    with tempfile.TemporaryDirectory(prefix="check-chart-") as tmp:
        labels: dict[str, str] = {}
        for index, (label, values) in enumerate(sets):
            counted = ""
            for kube in dict.fromkeys((oldest, newest)):
                try:
                    text = render(args.chart, values, kube)
                except RenderError as exc:
                    findings.append(Finding(label, f"helm template --kube-version {kube}", "(chart)", str(exc),
                                            "the chart does not render for a Kubernetes version kubeVersion claims"))
                    continue
                docs = [d for d in yaml.safe_load_all(text) if d]
                counted = f"{len(docs)} resources"
                findings.extend(validate_resources(label, docs, kube, crds))
                if kube == newest:
                    name = f"render-{index}.yaml"
                    (Path(tmp) / name).write_text(text)
                    labels[name] = label
            print(f"check-chart: {label}: rendered {counted or 'nothing'} for Kubernetes {oldest} and {newest}")
        if labels:
            findings.extend(checkov(tools_bin, Path(tmp), labels))

    if not findings:
        print(f"check-chart: OK: kubernetes-validate --strict {oldest} and {newest}, vendored CRD schemas, "
              f"checkov --framework kubernetes: no findings in {len(sets)} values set(s)")
        return 0
    print(f"check-chart: {len(findings)} finding(s):", file=sys.stderr)
    for f in findings:
        print(f"FAIL [{f.check}] {f.resource}  (values: {f.values})\n     {f.message}\n     -> {f.hint}",
              file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
