"""``toolproxy policy check``: the Rego compiles strictly, is formatted, is typed by the registry, and its
data agrees with the registry.

Owns: running ``opa check --strict`` and ``opa fmt --list`` on a policy
directory, the type check of the Rego against the registry's input schemas
(``policy_types``: ``opa_type_check``, ``argument_type_mismatch``,
``rule_for_unknown_tool``, each at a file and line), loading OPA data files the way ``opa run`` does (a JSON/YAML file
in ``a/b/`` under a data directory lands at ``data.a.b``) while remembering
which file holds which path, and the consistency rules between
``data.toolproxy`` and the tool registry:

* ``role_grants_unknown_tool``: a role grants a tool the registry lacks;
* ``tool_not_granted``: a registry tool no role grants (nobody can call it);
* ``destructive_without_approval``: a write tool of risk destructive while
  ``destructive`` is not in ``settings.approval.always_for_risks``;
* ``financial_without_threshold`` / ``financial_without_limit``: a financial
  write tool without an approval threshold / a hard ``max_amount`` limit;
* ``setting_for_unknown_tool``: a threshold, limit, scope override,
  never_for_agents or listing.hidden entry naming a tool the registry lacks;
* ``argument_not_in_schema``: a threshold or limit on an argument the tool's
  inputSchema has no integer/number property for (the rule never fires);
* ``resource_kind_without_ownership``: a registry resource template whose
  kind has no ``resource_kinds[kind].ownership`` (every call refused);
* ``ownership_invalid``: an ownership other than tenant, shared or at_write;
* ``policy_data_schema``: what ``check-policy-data`` says of ``data.toolproxy``
  (schemas/opa-data.schema.json and its cross references);
* ``package_never_reached`` (``policy_types``): a package the decision document
  never reads, whose rules therefore never apply.

Every problem names a file and a path in it. Must never: report a problem
without saying where it is.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import yaml

from ..config import deep_merge
from . import policy_types
from .policy_scratch import find_opa
from ..registry import Registry, ToolContract, load_registry, thaw

DATA_SUFFIXES = (".json", ".yaml", ".yml")
OWNERSHIPS = ("tenant", "shared", "at_write")


@dataclass(frozen=True)
class Problem:
    kind: str
    file: str
    path: str
    message: str

    def line(self) -> str:
        return f"{self.file}: {self.path}: {self.kind}: {self.message}"


class DataFiles:
    """OPA data merged from files, remembering the file behind every path."""

    def __init__(self, paths: list[str]) -> None:
        self.data: dict[str, Any] = {}
        self._files: list[tuple[tuple[str, ...], str, Any]] = []
        for root in paths:
            base = Path(root)
            files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.suffix in DATA_SUFFIXES)
            for file in files:
                prefix = () if base.is_file() else tuple(file.parent.relative_to(base).parts)
                text = file.read_text(encoding="utf-8")
                document = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
                self._files.append((prefix, str(file), document))
                target = self.data
                for part in prefix:
                    target = target.setdefault(part, {})
                deep_merge(target, document or {})

    def where(self, *path: str) -> str:
        """The file that holds ``path`` (the deepest one that has it), else the first data file."""
        for prefix, file, document in reversed(self._files):
            if path[:len(prefix)] != prefix:
                continue
            node = document
            for part in path[len(prefix):]:
                if not isinstance(node, dict) or part not in node:
                    break
                node = node[part]
            else:
                return file
        return self._files[0][1] if self._files else "(no data)"

    def get(self, *path: str, default: Any = None) -> Any:
        node: Any = self.data
        for part in path:
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node


def opa_problems(policy_dir: str, binary: str) -> list[Problem]:
    problems: list[Problem] = []
    done = subprocess.run([binary, "check", "--strict", "--format", "json", policy_dir],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        try:
            errors = json.loads(done.stdout or done.stderr).get("errors", [])
        except ValueError:
            errors = [{"message": (done.stderr or done.stdout).strip(), "location": {"file": policy_dir}}]
        for error in errors:
            location = error.get("location") or {}
            problems.append(Problem("opa_check", location.get("file", policy_dir),
                                    f"line {location.get('row', '?')}", error.get("message", "").strip()))
    listed = subprocess.run([binary, "fmt", "--list", policy_dir], capture_output=True, text=True, timeout=120)
    for file in listed.stdout.split():
        problems.append(Problem("opa_fmt", file, "-", "not formatted: run `opa fmt -w` on it"))
    return problems


def data_problems(data: DataFiles, registry: Registry) -> list[Problem]:
    return list(_data_schema_problems(data)) + list(_data_problems(data, registry))


def _data_schema_problems(data: DataFiles) -> Iterator[Problem]:
    """``check-policy-data``'s check of ``data.toolproxy`` (schemas/opa-data.schema.json and its cross
    references), when the data holds it."""
    from ..policy.data import problems

    if not isinstance(data.get("toolproxy"), dict):
        return
    for problem in problems({"toolproxy": data.get("toolproxy")}):
        path, _, message = problem.partition(": ")
        parts = [p for p in path.removeprefix("$").replace("[", ".").replace("]", "").split(".") if p]
        yield Problem("policy_data_schema", data.where(*parts), path, message)


SETTINGS = ("toolproxy", "settings")
CHECKS = "opa check --strict, opa fmt, Rego typed by the registry, policy data schema, policy data vs registry"


def _data_problems(data: DataFiles, registry: Registry) -> Iterator[Problem]:
    """Every check of the data document against the registry, one family per function."""
    tools = {t.name: t for t in registry.all()}
    yield from _role_problems(data, tools)
    yield from _risk_problems(data, tools)
    yield from _numeric_setting_problems(data, tools)
    yield from _tool_list_problems(data, tools)
    yield from _resource_kind_problems(data, tools)


def _role_problems(data: DataFiles, tools: Mapping[str, ToolContract]) -> Iterator[Problem]:
    roles = data.get("toolproxy", "roles", default={}) or {}
    granted: set[str] = set()
    for role, spec in sorted(roles.items()):
        for i, name in enumerate((spec or {}).get("tools", [])):
            if name == "*" or name in tools:
                granted.update(tools if name == "*" else [name])
            else:
                yield Problem("role_grants_unknown_tool", data.where("toolproxy", "roles", role, "tools"),
                              f"toolproxy.roles.{role}.tools[{i}]", f"role {role} grants {name!r}, not in the registry")
        yield from _role_list_problems(data, tools, role, spec or {})
    for name, tool in sorted(tools.items()):
        if name not in granted:
            yield Problem("tool_not_granted", tool.source, f"tools[name={name}]",
                          f"no role in toolproxy.roles grants {name}: nobody can call it")


# A role's other tool lists: (field, problem code, does a tool qualify, what the problem says).
_ROLE_LISTS = (
    ("compensate", "role_compensates_unknown_tool",  # policies/compensation.rego
     lambda tool: tool.compensation is not None,
     "may compensate {name!r}, which is no registry tool with a compensation"),
    ("operate_others", "role_operates_unknown_tool",  # policies/operations.rego
     lambda tool: True, "may act on other subjects' operations of {name!r}, not in the registry"),
)


def _role_list_problems(data: DataFiles, tools: Mapping[str, ToolContract], role: str,
                        spec: Mapping[str, Any]) -> Iterator[Problem]:
    for field_name, code, qualifies, says in _ROLE_LISTS:
        for i, name in enumerate(spec.get(field_name, [])):
            if name != "*" and (name not in tools or not qualifies(tools[name])):
                yield Problem(code, data.where("toolproxy", "roles", role, field_name),
                              f"toolproxy.roles.{role}.{field_name}[{i}]", f"role {role} " + says.format(name=name))


def _risk_problems(data: DataFiles, tools: Mapping[str, ToolContract]) -> Iterator[Problem]:
    always = data.get(*SETTINGS, "approval", "always_for_risks", default=[]) or []
    thresholds = data.get(*SETTINGS, "approval", "thresholds", default={}) or {}
    limits = data.get(*SETTINGS, "limits", "max_amount", default={}) or {}
    for name, tool in sorted(tools.items()):
        if not tool.is_write:
            continue
        if tool.risk == "destructive" and "destructive" not in always:
            yield Problem("destructive_without_approval", data.where(*SETTINGS, "approval"),
                          "toolproxy.settings.approval.always_for_risks",
                          f"{name} is destructive but destructive is not in always_for_risks")
        if tool.risk == "financial" and name not in thresholds:
            yield Problem("financial_without_threshold", data.where(*SETTINGS, "approval"),
                          f"toolproxy.settings.approval.thresholds.{name}",
                          f"{name} is financial and has no approval threshold (every call needs approval)")
        if tool.risk == "financial" and name not in limits:
            yield Problem("financial_without_limit", data.where(*SETTINGS, "limits"),
                          f"toolproxy.settings.limits.max_amount.{name}",
                          f"{name} is financial and has no hard max_amount limit")


def _numeric_setting_problems(data: DataFiles, tools: Mapping[str, ToolContract]) -> Iterator[Problem]:
    """Approval thresholds and amount limits: each names a registry tool and a numeric argument of it."""
    thresholds = data.get(*SETTINGS, "approval", "thresholds", default={}) or {}
    limits = data.get(*SETTINGS, "limits", "max_amount", default={}) or {}
    for section, entries in (("approval.thresholds", thresholds), ("limits.max_amount", limits)):
        for name, spec in sorted(entries.items()):
            where = data.where(*SETTINGS, *section.split("."), name)
            path = f"toolproxy.settings.{section}.{name}"
            if name not in tools:
                yield Problem("setting_for_unknown_tool", where, path, f"{name} is not in the registry")
            elif not _numeric_argument(tools[name], (spec or {}).get("argument")):
                yield Problem("argument_not_in_schema", where, path + ".argument",
                              f"{name} has no numeric argument {(spec or {}).get('argument')!r}: the rule never fires")


def _tool_list_problems(data: DataFiles, tools: Mapping[str, ToolContract]) -> Iterator[Problem]:
    """Scoped, never-for-agents and hidden tools: each names a registry tool."""
    for name in sorted(data.get(*SETTINGS, "scopes", "tools", default={}) or {}):
        if name not in tools:
            yield Problem("setting_for_unknown_tool", data.where(*SETTINGS, "scopes", "tools"),
                          f"toolproxy.settings.scopes.tools.{name}", f"{name} is not in the registry")
    for section in (("never_for_agents",), ("listing", "hidden")):
        for i, name in enumerate(data.get(*SETTINGS, *section, default=[]) or []):
            if name not in tools:
                yield Problem("setting_for_unknown_tool", data.where(*SETTINGS, *section),
                              f"toolproxy.settings.{'.'.join(section)}[{i}]", f"{name} is not in the registry")


def _resource_kind_problems(data: DataFiles, tools: Mapping[str, ToolContract]) -> Iterator[Problem]:
    kinds = data.get("toolproxy", "resource_kinds", default={}) or {}
    for kind, spec in sorted(kinds.items()):
        if (spec or {}).get("ownership") not in OWNERSHIPS:
            yield Problem("ownership_invalid", data.where("toolproxy", "resource_kinds", kind),
                          f"toolproxy.resource_kinds.{kind}.ownership",
                          f"ownership must be tenant, shared or at_write, not {(spec or {}).get('ownership')!r}")
    for name, tool in sorted(tools.items()):
        for i, resource in enumerate(tool.resources):
            kind = resource.template.partition(":")[0]
            if kind not in kinds:
                yield Problem("resource_kind_without_ownership", tool.source,
                              f"tools[name={name}].resources[{i}].template",
                              f"resource kind {kind!r} has no toolproxy.resource_kinds.{kind}.ownership "
                              "(every call is refused)")


def _numeric_argument(tool: ToolContract, argument: Any) -> bool:
    """The tool has an integer or number argument of that name, maybe nullable (``anyOf: [number, null]``,
    ``type: [number, "null"]``) or behind a ``$ref``: a threshold on it can fire."""
    if not isinstance(argument, str):
        return False
    schema = policy_types.inline_refs(thaw(tool.input_schema or {}))
    return bool({"integer", "number"} & policy_types.field_types(policy_types.opa_schema(schema), argument))


def type_problems(policy_dir: str, registry: Registry, binary: str, known: list[Problem],
                  decision_path: str = "toolproxy/decision") -> list[Problem]:
    """Rego typed by the registry (``policy_types``), minus what the plain strict check already said."""
    seen = {(p.file, p.path, p.message) for p in known}
    found = [Problem(p.kind, p.file, f"line {p.row}", p.message)
             for p in policy_types.check(policy_dir, registry, binary, decision_path=decision_path)]
    return [p for p in found if (p.file, p.path, p.message) not in seen]


def run_check(args: argparse.Namespace) -> int:
    binary = find_opa(args.opa)
    registry = load_registry(args.registry)
    problems = opa_problems(args.policy, binary)
    problems += type_problems(args.policy, registry, binary, problems, args.decision_path)
    problems += data_problems(DataFiles(args.data), registry)
    if args.format == "json":
        print(json.dumps({"problems": [asdict(p) for p in problems], "ok": not problems}, indent=2))
    else:
        for problem in problems:
            print(problem.line())
        print(f"{len(problems)} problem(s): {CHECKS} ({len(registry)} tools)" if problems else
              f"ok: {CHECKS} ({len(registry)} tools)")
    return 1 if problems else 0
