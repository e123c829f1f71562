"""`toolproxy policy check` types the Rego by the registry's contracts, with the real opa (issue 31, part 3).

A rule naming an argument its tool lacks, or comparing it with a value of another type, fails the check
with the file and the line; the shipped policies pass it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "policy-typed"
CHECK = [sys.executable, "-m", "proxy.cli", "policy", "check"]


def _check(policy: Path | str, registry: Path | str, data: Path | str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CHECK, "--policy", str(policy), "--registry", str(registry), "--data", str(data),
                           "--format", "json"], capture_output=True, text=True, timeout=300, cwd=REPO)


def _problems(done: subprocess.CompletedProcess[str]) -> set[tuple[str, str, str]]:
    return {(p["kind"], Path(p["file"]).name, p["path"]) for p in json.loads(done.stdout)["problems"]}


def test_a_mistyped_argument_fails_the_check_with_file_and_line():
    done = _check(FIXTURE / "policies", FIXTURE / "registry.yaml", FIXTURE / "data")
    assert done.returncode == 1, done.stdout + done.stderr
    problems = json.loads(done.stdout)["problems"]
    assert _problems(done) == {
        ("opa_type_check", "refunds.rego", "line 13"),          # input.arguments.ammount: no such argument
        ("opa_type_check", "refunds.rego", "line 19"),          # amount == "100": integer vs string
        ("argument_type_mismatch", "refunds.rego", "line 25"),  # amount > "100": OPA types > as any
        ("opa_type_check", "refunds.rego", "line 31"),          # get_order has no amount (refund_order has)
        ("opa_type_check", "refunds.rego", "line 37"),          # an enum of strings == 3
        ("rule_for_unknown_tool", "refunds.rego", "line 41"),   # guarded by a tool the registry lacks
        ("opa_type_check", "refunds.rego", "line 49"),          # unguarded: no registry tool has customer
        ("opa_type_check", "refunds.rego", "line 53"),          # input.subject.tenat
        ("opa_type_check", "annotated.rego", "line 8"),         # the author's package annotation
    }
    assert len(problems) == 9
    by_line = {(Path(p["file"]).name, p["path"]): p["message"] for p in problems}
    assert by_line[("refunds.rego", "line 13")] == \
        "undefined ref: input.arguments.ammount (want one of: amount, channel, order_id)"
    assert by_line[("refunds.rego", "line 19")] == "match error: number compared with string"
    assert "integer in refund_order, not a string; the comparison never holds" in by_line[("refunds.rego", "line 25")]
    assert by_line[("refunds.rego", "line 31")] == "undefined ref: input.arguments.amount (want one of: order_id)"


def test_the_authors_files_are_not_touched(tmp_path):
    before = {p.name: p.read_bytes() for p in (FIXTURE / "policies").iterdir()}
    _check(FIXTURE / "policies", FIXTURE / "registry.yaml", FIXTURE / "data")
    assert {p.name: p.read_bytes() for p in (FIXTURE / "policies").iterdir()} == before


def test_a_fixed_policy_passes(tmp_path):
    text = (FIXTURE / "policies" / "refunds.rego").read_text()
    fixed = tmp_path / "policies"
    fixed.mkdir()
    (fixed / "refunds.rego").write_text(text.split("\n\n# A misspelt argument")[0] + "\n")
    done = _check(fixed, FIXTURE / "registry.yaml", FIXTURE / "data")
    assert done.returncode == 0, done.stdout
    assert json.loads(done.stdout) == {"problems": [], "ok": True}


def test_the_shipped_policies_pass_the_typed_check():
    done = _check(REPO / "policies", REPO / "examples" / "registry", REPO / "examples" / "opa")
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_authors_own_root_annotation_is_kept_and_still_types_input(tmp_path):
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "root.rego").write_text("# METADATA\n# scope: subpackages\n# title: the authors' own\n"
                                        "package toolproxy\n")
    (policies / "rule.rego").write_text('package toolproxy.extra\n\ndeny contains "x" if input.subject.tenat == "x"\n')
    done = _check(policies, FIXTURE / "registry.yaml", FIXTURE / "data")
    assert _problems(done) == {("opa_type_check", "rule.rego", "line 3")}
