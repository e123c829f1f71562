"""Which input paths a policy reads: the soundness check behind "not replayable".

A decision record masks sensitive arguments. Replaying it is only honest if
the candidate policy's decision cannot depend on the masked values. Three
steps, each sound, cheapest first:

1. **Static refs** (once per policy): ``opa parse`` every non-test module and
   collect each rule's refs into ``input`` (and ``import input...``); a
   segment that is not a literal (``input.arguments[k]``) matches anything.
   A record whose masked paths no ref can reach is replayable. The same refs
   give the *projection* of an input (the parts the policy may read): equal
   projections get equal decisions, so replay evaluates each one once.
2. **Partial evaluation of the rules that may reach them** (per record):
   each such rule's document is partially evaluated with the record's input
   known except the masked paths. OPA folds everything that does not need
   an unknown; a residual that still mentions ``input`` (or saves a rule
   it could not inline) may depend on the masked value.
3. **Trace** (per record, only when step 2 cannot answer: functions, rules
   with ``else``, residuals that saved a rule): the decision's full trace is
   read for every evaluated expression whose ``input`` ref, with its bound
   variables filled in, reaches a masked path. Evaluation is deterministic
   given the input, so a masked value can only change the decision through
   an expression that reads it.

Owns: that analysis. Must never: guess (anything it cannot show independent
is reported as reading the masked path).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..policy.opa_control import ControlError

WILD = object()
INPUT = {"type": "var", "value": "input"}


@dataclass(frozen=True)
class RuleReads:
    document: str                 # "data.toolproxy.approvals.needs"
    location: str                 # "policies/approvals.rego:27"
    partially_evaluable: bool     # no arguments (not a function), no else
    patterns: tuple[tuple[Any, ...], ...]


def policy_reads(policy_dir: str, opa_binary: str) -> list[RuleReads]:
    rules: dict[str, RuleReads] = {}
    for file in sorted(Path(policy_dir).rglob("*.rego")):
        if file.name.endswith("_test.rego"):
            continue
        for reads in _module_reads(file, _parse(file, opa_binary)):
            previous = rules.get(reads.document)
            if previous is not None:  # several definitions of one document: merge them
                reads = RuleReads(reads.document, reads.location,
                                  reads.partially_evaluable and previous.partially_evaluable,
                                  previous.patterns + reads.patterns)
            rules[reads.document] = reads
    return list(rules.values())


def _parse(file: Path, opa_binary: str) -> dict[str, Any]:
    done = subprocess.run([opa_binary, "parse", "--format", "json", "--json-include", "locations", str(file)],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise ControlError(f"{file}: opa parse failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


def _module_reads(file: Path, module: dict[str, Any]) -> Iterator[RuleReads]:
    """What each rule of one parsed module reads of ``input`` (rules that read nothing are left out)."""
    package = [t["value"] for t in module["package"]["path"]]
    # ``import input.subject as s`` makes ``s.id`` a read of input.subject: every rule may use it.
    imported = tuple(_input_patterns([i.get("path") for i in module.get("imports") or ()]))
    for rule in module.get("rules", []):
        patterns = tuple(_input_patterns(rule)) + imported
        if not patterns:
            continue
        head = rule["head"]
        name = [t["value"] for t in head.get("ref", [])] or [head["name"]]
        document = ".".join(package + [str(n) for n in name if isinstance(n, str)])
        evaluable = "args" not in head and "else" not in rule and all(isinstance(n, str) for n in name)
        yield RuleReads(document, f"{file}:{rule['location']['row']}", evaluable, patterns)


def _input_patterns(node: Any) -> list[tuple[Any, ...]]:
    return [tuple(_segment(t) for t in ref[1:]) for ref in _refs(node)]


def _is_input(term: Any) -> bool:
    return isinstance(term, dict) and term.get("type") == "var" and term.get("value") == "input"


def _segment(term: dict[str, Any], bindings: dict[str, Any] | None = None) -> Any:
    if term.get("type") in ("string", "number"):
        return term["value"]
    if term.get("type") == "var" and bindings and term["value"] in bindings:
        return bindings[term["value"]]
    return WILD


def reaches(pattern: Sequence[Any], path: Sequence[Any]) -> bool:
    """Whether a ref pattern may read ``path`` (itself, a parent holding it, or a part of it)."""
    return all(p is WILD or p == q for p, q in zip(pattern, path))


def project(value: Any, patterns: Sequence[Sequence[Any]]) -> Any:
    """The part of ``value`` that some pattern may read; two inputs with equal projections get equal decisions."""
    if any(len(p) == 0 for p in patterns):
        return value
    if isinstance(value, dict):
        out = {}
        for key, sub in value.items():
            below = [p[1:] for p in patterns if p[0] is WILD or p[0] == key]
            if below:
                out[key] = project(sub, below)
        return out
    if isinstance(value, list):
        return [project(item, below) if (below := [p[1:] for p in patterns if p[0] is WILD or p[0] == i])
                else None for i, item in enumerate(value)]
    return value


def all_patterns(rules: Sequence[RuleReads]) -> list[tuple[Any, ...]]:
    return [p for rule in rules for p in rule.patterns]


def rules_reaching(rules: Sequence[RuleReads], paths: Sequence[Sequence[Any]]) -> list[RuleReads]:
    return [r for r in rules if any(reaches(p, m) for p in r.patterns for m in paths)]


def residual_needs_input(answer: Any) -> bool:
    """A partial-evaluation residual that mentions input, or saved a rule instead of inlining it."""
    if isinstance(answer, dict):
        if answer.get("type") == "ref" and isinstance(answer.get("value"), list) and answer["value"]:
            head = answer["value"][0]
            if _is_input(head):
                return True
            if head == {"type": "var", "value": "data"} and len(answer["value"]) > 1 \
                    and answer["value"][1].get("value") != "partial":
                return True
        return any(residual_needs_input(v) for v in answer.values())
    if isinstance(answer, list):
        return any(residual_needs_input(v) for v in answer)
    return False


def trace_reads(explanation: Sequence[dict[str, Any]], paths: Sequence[Sequence[Any]]) -> bool:
    """Whether any evaluated expression of a full trace reads one of ``paths``."""
    for event in explanation:
        if event.get("op") != "eval":
            continue
        bindings = {}
        for local in event.get("locals") or ():
            value = local.get("value") or {}
            if value.get("type") in ("string", "number"):
                bindings[local["key"]["value"]] = value["value"]
        for ref in _refs(event.get("node")):
            pattern = tuple(_segment(t, bindings) for t in ref[1:])
            if any(reaches(pattern, m) for m in paths):
                return True
    return False


def _refs(node: Any) -> list[list[dict[str, Any]]]:
    found: list[list[dict[str, Any]]] = []
    if isinstance(node, dict):
        if node.get("type") == "ref" and isinstance(node.get("value"), list) and node["value"] \
                and _is_input(node["value"][0]):
            found.append(node["value"])
            for term in node["value"][1:]:
                found.extend(_refs(term))
            return found
        if _is_input(node):
            return [[node]]
        for value in node.values():
            found.extend(_refs(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(_refs(value))
    return found
