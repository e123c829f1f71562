"""``toolproxy policy check``'s type check: Rego is typed by the registry's contracts.

Owns: turning the registry and ``schemas/opa-input.schema.json`` into a schema
directory for OPA's own type checker (``opa check --strict --schema DIR``) and
tying rules to tools, then mapping what OPA finds back to the author's file and
line:

* ``input.json`` types every rule's ``input`` (the input contract); in it
  ``input.arguments`` is "one of the registry tools' inputSchemas", so an
  argument no tool has fails wherever it is read;
* ``tools/<name>.json`` is one tool's arguments (the union of its versions);
  an author ties a rule or a package to it with a METADATA annotation
  ``schemas: [input.arguments: schema.tools.<name>]``;
* a rule guarded by ``input.tool.name == "x"`` (or ``input.tool.name in
  {"x", "y"}``) in every body is tied to those tools without any annotation:
  the check runs on a scratch copy of the policy into which that annotation is
  written (and the ``input`` one on each root package), never on the author's
  files;
* OPA types ``==``, ``=``, ``:=`` and builtin arguments, but its ordering
  operators and ``!=`` take any two values; so an ordering or ``!=`` between an
  argument and a literal of another type is flagged here
  (``argument_type_mismatch``): it always or never holds;
* a guard naming a tool the registry lacks is flagged (``rule_for_unknown_tool``):
  the rule never matches.

Must never: edit the author's files, or report a problem without its file and line.
"""

from __future__ import annotations

import copy
import json
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from ..registry import Registry, thaw

INPUT_SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "opa-input.schema.json"
PARSERS = 4  # `opa parse` processes at once
ORDERING = {"gt": ">", "lt": "<", "gte": ">=", "lte": "<=", "neq": "!="}
_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null",
               list: "array", dict: "object"}


@dataclass(frozen=True)
class TypeProblem:
    kind: str
    file: str
    row: int
    message: str


# --- the schema directory --------------------------------------------------------------------------------

def opa_schema(schema: Any) -> Any:
    """A JSON Schema as OPA's type checker reads it: conditional requirements (if/then/else, which type
    nothing) and ``allOf`` parts that type nothing (``{"minLength": 2}``: OPA cannot merge them with a
    typed part) dropped, ``oneOf`` read as ``anyOf``, and an ``enum``/``const`` of one JSON type given that
    type (OPA types a bare enum as any)."""
    if isinstance(schema, list):
        return [opa_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: opa_schema(value) for key, value in schema.items() if key not in ("if", "then", "else")}
    if "allOf" in out:  # OPA merges the parts and cannot merge a typed one with an untyped one
        kept = [part for part in out.pop("allOf") if isinstance(part, dict) and _typed(part)]
        if kept:
            out["allOf"] = kept
    if "oneOf" in out:
        out["anyOf"] = out.pop("oneOf")
    if "type" not in out:
        _type_the_enum(out)
    return out


def inline_refs(schema: Any, root: Any = None, depth: int = 0) -> Any:
    """The schema with every local ``$ref`` (``#/$defs/Status``, as pydantic and ``import-mcp`` write them)
    replaced by what it points at, and ``$defs``/``definitions`` dropped: OPA reads a tool's schema inside
    the input document, where ``#/...`` would point at the document's root, so every rule reading such an
    argument failed to type. A ref that recurses (or is not local) past a few levels becomes untyped."""
    root = schema if root is None else root
    if isinstance(schema, list):
        return [inline_refs(item, root, depth) for item in schema]
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _pointer(root, ref) if depth < 8 else None
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        if target is None:
            return inline_refs(rest, root, depth)  # what it could not resolve is not typed
        resolved = inline_refs(target, root, depth + 1)
        return {**resolved, **inline_refs(rest, root, depth)} if isinstance(resolved, dict) else resolved
    return {key: inline_refs(value, root, depth) for key, value in schema.items()
            if key not in ("$defs", "definitions")}


def _pointer(root: Any, ref: str) -> Any:
    """What a local JSON pointer (``#/a/b``) names in ``root``, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in [p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/") if p]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _type_the_enum(schema: dict[str, Any]) -> None:
    """An untyped ``enum``/``const`` whose values share one JSON type gets that type."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if not values:
        return
    kinds = {_json_type(v) for v in values}
    kinds = {"number"} if kinds == {"integer", "number"} else kinds
    if len(kinds) == 1:
        schema["type"] = kinds.pop()


def _typed(part: Mapping[str, Any]) -> bool:
    return bool({"type", "properties", "items", "$ref", "anyOf", "allOf"} & set(part))


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), "any")


def _union(schemas: list[Any]) -> Any:
    distinct: list[Any] = []
    for schema in schemas:
        if schema not in distinct:
            distinct.append(schema)
    return distinct[0] if len(distinct) == 1 else {"anyOf": distinct}


def tool_schemas(registry: Registry) -> dict[str, Any]:
    """Tool name -> its arguments' schema for OPA (the union of its versions' inputSchemas)."""
    versions: dict[str, list[Any]] = {}
    for tool in registry.all():
        versions.setdefault(tool.name, []).append(opa_schema(inline_refs(thaw(tool.input_schema))))
    return {name: _union(schemas) for name, schemas in sorted(versions.items())}


def write_schema_dir(target: Path, tools: Mapping[str, Any], input_schema: Mapping[str, Any]) -> None:
    """``input.json`` (the input contract, arguments = any registry tool's) and ``tools/<name>.json``."""
    document = opa_schema(copy.deepcopy(dict(input_schema)))
    document.setdefault("properties", {})["arguments"] = _union(list(tools.values())) if tools else {"type": "object"}
    (target / "tools").mkdir(parents=True, exist_ok=True)
    (target / "input.json").write_text(json.dumps(document), encoding="utf-8")
    for name, schema in tools.items():
        (target / "tools" / f"{name}.json").write_text(json.dumps(schema), encoding="utf-8")


# --- reading the policy's AST -------------------------------------------------------------------------------

def parse_module(binary: str, file: Path) -> dict[str, Any]:
    done = subprocess.run([binary, "parse", "--format", "json", "--json-include", "locations,-comments", str(file)],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return {}  # a file that does not parse: `opa check` reports it
    return json.loads(done.stdout)


def _is_ref(term: Any, *path: str) -> bool:
    if not isinstance(term, dict) or term.get("type") != "ref":
        return False
    parts = term["value"]
    return len(parts) == len(path) and parts[0].get("value") == path[0] and all(
        p.get("type") == "string" and p.get("value") == want for p, want in zip(parts[1:], path[1:]))


def _operator(expr: Mapping[str, Any]) -> str | None:
    terms = expr.get("terms")
    if not isinstance(terms, list) or not terms or terms[0].get("type") != "ref":
        return None
    return ".".join(str(p.get("value")) for p in terms[0]["value"])


def guard_tools(body: list[Mapping[str, Any]]) -> set[str] | None:
    """The tool names a body is guarded to (``input.tool.name == "x"`` / ``in {...}``), None when unguarded."""
    found: set[str] | None = None
    for expr in body:
        if expr.get("negated"):
            continue
        names = _guard(expr)
        if names is not None:
            found = names if found is None else found & names
    return found


def _guard(expr: Mapping[str, Any]) -> set[str] | None:
    operator, terms = _operator(expr), expr.get("terms") or []
    if operator in ("equal", "eq") and len(terms) == 3:
        for ref, literal in ((terms[1], terms[2]), (terms[2], terms[1])):
            if _is_ref(ref, "input", "tool", "name") and literal.get("type") == "string":
                return {literal["value"]}
    if operator == "internal.member_2" and len(terms) == 3 and _is_ref(terms[1], "input", "tool", "name") \
            and terms[2].get("type") in ("set", "array"):
        items = terms[2]["value"]
        if all(item.get("type") == "string" for item in items):
            return {item["value"] for item in items}
    return None


def _bodies(rule: Mapping[str, Any]) -> Iterator[list[Mapping[str, Any]]]:
    node: Any = rule
    while isinstance(node, dict):
        yield node.get("body") or []
        node = node.get("else")


def rule_tools(rule: Mapping[str, Any]) -> set[str] | None:
    """The tools a rule is tied to by its guards: every body (else branches too) must be guarded."""
    union: set[str] = set()
    for body in _bodies(rule):
        names = guard_tools(body)
        if names is None:
            return None
        union |= names
    return union


def _row(node: Mapping[str, Any]) -> int:
    return int((node.get("location") or {}).get("row", 0))


# --- the scratch copy --------------------------------------------------------------------------------------

class Annotated:
    """One Rego file of the scratch copy: the author's lines plus inserted annotation lines, and the way back."""

    def __init__(self, text: str) -> None:
        self._lines = text.split("\n")
        self._inserts: dict[int, list[str]] = {}

    def insert_before(self, row: int, lines: list[str]) -> None:
        self._inserts.setdefault(row, []).extend(lines)

    def render(self) -> tuple[str, list[int]]:
        """The scratch text and, per scratch row (1-based, index row-1), the author's row."""
        out: list[str] = []
        back: list[int] = []
        for number, line in enumerate(self._lines, start=1):
            for extra in self._inserts.get(number, []):
                out.append(extra)
                back.append(number)
            out.append(line)
            back.append(number)
        return "\n".join(out), back


# --- the check ---------------------------------------------------------------------------------------------

def check(policy_dir: str, registry: Registry, binary: str,
          input_schema_path: Path = INPUT_SCHEMA, decision_path: str = "toolproxy/decision") -> list[TypeProblem]:
    """Every type problem of the Rego under ``policy_dir`` against ``registry``, with file and line, and
    every package the decision document never reads (``package_never_reached``)."""
    tools = tool_schemas(registry)
    input_schema = json.loads(input_schema_path.read_text(encoding="utf-8"))
    base = Path(policy_dir)
    files = [base] if base.is_file() else sorted(base.rglob("*.rego"))
    tying = _Tying(tools)
    problems: list[TypeProblem] = []
    with tempfile.TemporaryDirectory(prefix="toolproxy-typed-") as scratch:
        schema_dir, copy_dir = Path(scratch) / "schemas", Path(scratch) / "policy"
        copy_dir.mkdir()
        back: dict[str, tuple[str, list[int]]] = {}
        with ThreadPoolExecutor(max_workers=PARSERS) as pool:  # one `opa parse` process per file
            modules = list(pool.map(lambda f: parse_module(binary, f), files))
        problems.extend(unreached_packages(files, modules, decision_path))
        for index, (file, module) in enumerate(zip(files, modules)):
            annotated = Annotated(file.read_text(encoding="utf-8"))
            problems.extend(tying.annotate(module, annotated, str(file)))
            text, rows = annotated.render()
            target = copy_dir / f"m{index:04d}_{file.name}"
            target.write_text(text, encoding="utf-8")
            back[str(target)] = (str(file), rows)
        for i, root in enumerate(tying.uncovered_roots()):
            (copy_dir / f"zz_typed_root_{i}.rego").write_text(
                "# METADATA\n# scope: subpackages\n# schemas:\n#   - input: schema.input\n"
                f"package {root}\n", encoding="utf-8")
        write_schema_dir(schema_dir, tools, input_schema)
        (schema_dir / "guards").mkdir()
        for name, schema in tying.unions.items():
            (schema_dir / "guards" / f"{name}.json").write_text(json.dumps(schema), encoding="utf-8")
        problems.extend(_opa_type_errors(binary, schema_dir, copy_dir, back))
    return sorted(problems, key=lambda p: (p.file, p.row, p.kind, p.message))


def unreached_packages(files: list[Path], modules: list[Mapping[str, Any]], decision_path: str) -> list[TypeProblem]:
    """Packages the decision document never reads, directly or through the packages it reads (an import or a
    ``data.`` reference): their rules pass every check and never apply. Test modules are not rules."""
    packages, reads, rules = _package_graph(files, modules)
    start = tuple(p for p in decision_path.split("/") if p)
    if start not in rules:
        return []  # the decision is not among these files (a library of rules, a partial bundle): nothing to say
    reached = _reached_packages(start, packages, reads)
    entry = "data." + ".".join(start)
    return [TypeProblem("package_never_reached", file, row,
                        f"package {'.'.join(package)} is never read by the decision ({entry}): its rules never "
                        f"apply. Put them in a package the decision reads (a deny rule in toolproxy.tools, "
                        f"an approval reason in toolproxy.approvals' needs: docs/policy-authors.md#your-first-rule)")
            for package, places in sorted(packages.items()) if package not in reached for file, row in places]


_Package = tuple[str, ...]


def _package_graph(files: list[Path], modules: list[Mapping[str, Any]]
                   ) -> tuple[dict[_Package, list[tuple[str, int]]], dict[_Package, set[_Package]], set[_Package]]:
    """Of the rule modules (not tests): where each package is declared (file, row), the ``data.`` paths each
    package reads, and the path of every rule."""
    packages: dict[_Package, list[tuple[str, int]]] = {}
    reads: dict[_Package, set[_Package]] = {}
    rules: set[_Package] = set()
    for file, module in zip(files, modules):
        package = _rule_package(file, module)
        if package is None:
            continue
        packages.setdefault(package, []).append((str(file), int(module["package"].get("location", {}).get("row", 1))))
        reads.setdefault(package, set()).update(_data_refs({k: v for k, v in module.items() if k != "package"}))
        rules.update(package + (str(rule["head"].get("name") or rule["head"]["ref"][0]["value"]),)
                     for rule in module.get("rules", []))
    return packages, reads, rules


def _rule_package(file: Path, module: Mapping[str, Any]) -> _Package | None:
    """The package a parsed module declares, or None for an empty module or a test."""
    if not module or file.name.endswith("_test.rego"):
        return None
    package = tuple(str(part["value"]) for part in module["package"]["path"][1:])
    if package and package[-1].endswith("_test"):
        return None
    return package


def _reached_packages(start: _Package, packages: Mapping[_Package, Any],
                      reads: Mapping[_Package, set[_Package]]) -> set[_Package]:
    """The packages a read of ``start`` reaches: the ones it lies in or holds, then theirs, transitively."""
    reached: set[_Package] = set()
    pending = [start]
    while pending:
        path = pending.pop()
        for package in packages:
            if package not in reached and (path[:len(package)] == package or package[:len(path)] == path):
                reached.add(package)
                pending.extend(reads[package])
    return reached


def _data_refs(node: Any) -> Iterator[tuple[str, ...]]:
    """Every ``data.a.b`` path a parsed module refers to (its imports and its rules), up to the first
    non-constant part."""
    if isinstance(node, dict):
        if node.get("type") == "ref" and isinstance(node.get("value"), list):
            parts = node["value"]
            if parts and parts[0].get("type") == "var" and parts[0].get("value") == "data":
                path = []
                for part in parts[1:]:
                    if part.get("type") != "string":
                        break
                    path.append(str(part["value"]))
                yield tuple(path)
        for value in node.values():
            yield from _data_refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _data_refs(item)


class _Tying:
    """Ties each module's guarded rules to their tools (annotations in the scratch copy) and checks the
    comparisons OPA does not type."""

    def __init__(self, tools: Mapping[str, Any]) -> None:
        self.tools = tools
        self.unions: dict[str, Any] = {}
        self._roots: dict[str, bool] = {}  # root package -> the author's own subpackages annotation has it

    def uncovered_roots(self) -> list[str]:
        return sorted(root for root, covered in self._roots.items() if not covered)

    def annotate(self, module: Mapping[str, Any], annotated: Annotated, file: str) -> Iterator[TypeProblem]:
        if not module:
            return
        self._root(module, annotated)
        for rule in module.get("rules") or []:
            names = rule_tools(rule)
            known = sorted(names & set(self.tools)) if names is not None else sorted(self.tools)
            for name in sorted((names or set()) - set(self.tools)):
                yield TypeProblem("rule_for_unknown_tool", file, _row(rule),
                                  f"guarded by input.tool.name == {name!r}, not in the registry: the rule never matches")
            yield from _comparisons(rule, file, {n: self.tools[n] for n in known})
            own = _schemas_of(rule.get("annotations") or [])
            if names is None or not known or own:
                continue  # unguarded (typed by input.json), nothing to tie it to, or the author typed it
            header = [] if own is not None else ["", "# METADATA"]
            annotated.insert_before(_row(rule), [*header, "# schemas:",
                                                 f"#   - input.arguments: {self._ref(known)}"])

    def _ref(self, names: list[str]) -> str:
        if len(names) == 1:
            name = names[0]
            return f"schema.tools.{name}" if name.replace("_", "a").isalnum() else f'schema.tools["{name}"]'
        key = "+".join(names)
        self.unions[key] = {"anyOf": [self.tools[n] for n in names]}
        return f'schema.guards["{key}"]'

    def _root(self, module: Mapping[str, Any], annotated: Annotated) -> None:
        """``input`` typed on each root package: by a generated file, or in the author's own subpackages
        annotation of that package (OPA allows one)."""
        path = [p.get("value") for p in module["package"]["path"][1:]]
        if not path:
            return
        root, package_row = str(path[0]), _row(module["package"])
        own = [a for a in module.get("annotations") or []
               if a.get("scope") == "subpackages" and _row(a) < package_row]
        if len(path) == 1 and own:
            self._roots[root] = True
            if not any("input" in entry for entry in own[0].get("schemas") or []):
                annotated.insert_before(package_row, ["# schemas:", "#   - input: schema.input"])
        else:
            self._roots.setdefault(root, False)


def _schemas_of(annotations: Iterable[Mapping[str, Any]]) -> list[Any] | None:
    """The schemas of a rule's own METADATA block ([] when it has none), None when it has no block."""
    for annotation in annotations:
        if annotation.get("scope") in ("rule", "document"):
            return annotation.get("schemas") or []
    return None


def _comparisons(rule: Mapping[str, Any], file: str, tools: Mapping[str, Any]) -> Iterator[TypeProblem]:
    """``input.arguments.x OP literal`` (OP an ordering or ``!=``) where no tied tool's ``x`` has the
    literal's type: the comparison always or never holds."""
    for body in _bodies(rule):
        for expr in body:
            operator, terms = _operator(expr), expr.get("terms") or []
            if operator not in ORDERING or len(terms) != 3:
                continue
            for ref, literal in ((terms[1], terms[2]), (terms[2], terms[1])):
                problem = _comparison_problem(expr, operator, ref, literal, file, tools)
                if problem is not None:
                    yield problem


def _comparison_problem(expr: Mapping[str, Any], operator: str, ref: Any, literal: Any, file: str,
                        tools: Mapping[str, Any]) -> TypeProblem | None:
    """The mismatch of ``ref OP literal``; None when ``ref`` is no argument, the literal no scalar, or some
    tied tool's field may hold the literal's type (or any type)."""
    field = _argument(ref)
    kind = literal.get("type") if isinstance(literal, dict) else None
    if field is None or kind not in ("number", "string", "boolean", "null"):
        return None
    declared = {t for schema in tools.values() for t in field_types(schema, field)}
    if not declared or "any" in declared or _compatible(kind, declared):
        return None
    return TypeProblem(
        "argument_type_mismatch", file, _row(expr),
        f"input.arguments.{field} {ORDERING[operator]} {json.dumps(literal.get('value'))}: "
        f"{field} is {'/'.join(sorted(declared))} in {', '.join(sorted(tools))}, not a {kind}; "
        f"the comparison {'always' if operator == 'neq' else 'never'} holds")


def _argument(term: Any) -> str | None:
    if not isinstance(term, dict) or term.get("type") != "ref":
        return None
    parts = term["value"]
    if len(parts) == 3 and parts[0].get("value") == "input" and parts[1].get("value") == "arguments" \
            and parts[2].get("type") == "string":
        return str(parts[2]["value"])
    return None


def field_types(schema: Any, field: str) -> set[str]:
    """The JSON types a tool's argument ``field`` may have ("any" when the schema does not say)."""
    if not isinstance(schema, dict):
        return {"any"}
    if "anyOf" in schema:
        return {t for part in schema["anyOf"] for t in field_types(part, field)}
    spec = (schema.get("properties") or {}).get(field)
    if spec is None:
        return set()
    return _types(spec)


def _types(spec: Any) -> set[str]:
    if not isinstance(spec, dict):
        return {"any"}
    if "anyOf" in spec:
        return {t for part in spec["anyOf"] for t in _types(part)}
    kind = spec.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {str(k) for k in kind}
    return {"any"}


def _compatible(literal: str, declared: set[str]) -> bool:
    return literal in declared or (literal == "number" and bool(declared & {"integer", "number"}))


def _opa_type_errors(binary: str, schema_dir: Path, copy_dir: Path,
                     back: Mapping[str, tuple[str, list[int]]]) -> list[TypeProblem]:
    """``opa check --strict --schema`` on the scratch copy: its type errors, at the author's file and line."""
    done = subprocess.run([binary, "check", "--strict", "--max-errors", "-1", "--format", "json",
                           "--schema", str(schema_dir), str(copy_dir)], capture_output=True, text=True, timeout=120)
    if done.returncode == 0:
        return []
    try:
        errors = json.loads(done.stdout or done.stderr).get("errors", [])
    except ValueError:
        raise ValueError("opa check --schema failed: " + (done.stderr or done.stdout).strip()[:500]) from None
    problems = []
    for error in errors:
        if error.get("code") != "rego_type_error":
            continue  # not a type error: the plain `opa check --strict` reports it on the author's files
        location = error.get("location") or {}
        file, rows = back.get(location.get("file", ""), (location.get("file", "?"), []))
        row = int(location.get("row", 0))
        problems.append(TypeProblem("opa_type_check", file, rows[row - 1] if 0 < row <= len(rows) else row,
                                    _message(error)))
    return problems


def _message(error: Mapping[str, Any]) -> str:
    message = str(error.get("message", "")).strip()
    details = error.get("details") or {}
    if details.get("oneOf"):
        return f"{message} (want one of: {', '.join(map(str, details['oneOf']))})"
    if {"a", "b"} <= set(details):
        return f"{message}: {_type_name(details['a'])} compared with {_type_name(details['b'])}"
    if details.get("have") is not None:
        return f"{message}: have {', '.join(_type_name(t) for t in details['have'])}"
    return message


def _type_name(value: Any) -> str:
    if isinstance(value, dict):
        kind = value.get("type", "?")
        if kind == "any" and value.get("of"):
            return "any<" + ", ".join(_type_name(v) for v in value["of"]) + ">"
        return str(kind)
    return str(value)
