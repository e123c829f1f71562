"""Imports inside ``proxy/`` run one way: authoring → fronts → process → batch → pipeline → transactions →
adapters → policy → credentials → guard → the stages and stores at the package's face → telemetry → wire.

Parses every module of the package (ast, nothing is imported) and fails on
any import cycle, counting every import: module level, inside functions and
under ``TYPE_CHECKING`` alike — a type-only import upward is still a layer
reaching up.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tests.unit import REPO, parsed, walk

PACKAGE = REPO / "proxy"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    return {name: set(targets) for name, targets in _import_graph().items()}  # a copy: checks never share edits


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in walk(parsed(path)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [source] + [f"{source}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_holds_relative_and_absolute_imports():
    graph = import_graph()
    assert "proxy.requests" in graph["proxy.pipeline"]
    assert "proxy.adapters" in graph["proxy.pipeline"]


def test_proxy_has_no_import_cycle():
    graph = import_graph()
    problems = [" → ".join(c) + "  (" + "; ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c) + ")"
                for c in cycles(graph)]
    assert not problems, "import cycles in proxy/:\n" + "\n".join(problems)


# The wings of the package, lowest first (calltokens: the call-token signer and the verifier backend owners
# import, which must not pull in the rest of the proxy; guard: the init container's egress rules, which need
# only the setting error; process: what the running process opens and watches, held by the fronts above it).
# A module may import its own tier and any tier below it, never one above. The face of the package
# (``proxy/*.py``: the stages and their values) is the "core" tier, except the few face modules that assemble
# the others, named in FACE_TIERS (and the package itself, which holds only its version).
TIERS = ["calltokens", "wire", "telemetry", "core", "guard", "credentials", "policy", "adapters", "transactions",
         "pipeline", "batch", "process", "fronts", "authoring"]
WINGS = {"calltokens", "wire", "telemetry", "guard", "credentials", "policy", "adapters", "transactions", "batch",
         "process", "fronts", "authoring"}
FACE_TIERS = {"proxy": "wire", "proxy.pipeline": "pipeline", "proxy.cli": "authoring"}


def tier(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in WINGS:
        return parts[1]
    return FACE_TIERS.get(module, "core")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    rank = {name: i for i, name in enumerate(TIERS)}
    return sorted(f"{m} ({tier(m)}) imports {t} ({tier(t)})" for m, targets in graph.items() for t in targets
                  if rank[tier(t)] > rank[tier(m)])


def test_the_tier_checker_sees_an_upward_import():
    assert upward_imports({"proxy.wire.http": {"proxy.fronts.app"}, "proxy.fronts.app": set()}) == [
        "proxy.wire.http (wire) imports proxy.fronts.app (fronts)"]
    assert upward_imports({"proxy.fronts.app": {"proxy.wire.http"}, "proxy.wire.http": set()}) == []
    assert tier("proxy.fronts.mcp.front") == "fronts" and tier("proxy.store") == "core"


def test_every_module_sits_in_a_known_tier():
    graph = import_graph()
    assert {tier(m) for m in graph} == set(TIERS)


def test_no_wing_imports_a_wing_above_it():
    problems = upward_imports(import_graph())
    assert not problems, "upward imports in proxy/:\n" + "\n".join(problems)


def test_the_package_has_0_cycles_and_0_arrows_up():
    """The two facts together, counted over every module, with no face module lifted to a wing's tier but
    the pipeline (the stage list) and the command line (the entry point)."""
    graph = import_graph()
    assert (len(cycles(graph)), len(upward_imports(graph))) == (0, 0)
    assert set(FACE_TIERS) == {"proxy", "proxy.pipeline", "proxy.cli"}


def test_the_running_process_lives_in_its_wing():
    """What one process opens, watches and closes sits below the fronts that hold it: a front imports the
    runtime, never the other way round."""
    graph = import_graph()
    assert {"proxy.process.runtime", "proxy.process.registry_reload", "proxy.process.health",
            "proxy.process.drain"} <= set(graph)
    assert "proxy.process.runtime" in graph["proxy.fronts.app"]
    assert not [t for m, targets in graph.items() if m.startswith("proxy.process") for t in targets
                if t.startswith("proxy.fronts")]


def test_the_egress_guard_stands_apart():
    """The init container's rules import only the setting error, and only the command line imports them."""
    graph = import_graph()
    needs = {t for m, targets in graph.items() if m.startswith("proxy.guard") for t in targets
             if not t.startswith("proxy.guard")}
    assert needs == {"proxy.config"}
    users = {m for m, targets in graph.items() if not m.startswith("proxy.guard")
             and any(t.startswith("proxy.guard") for t in targets)}
    assert users == {"proxy.cli"}


def test_only_the_store_speaks_redis_py_errors():
    """One error vocabulary: stages catch ``proxy.store.StoreError``; only the store (and its hot-path wire,
    which raises redis-py's own exceptions so nothing above it can tell the two apart) imports them."""
    speakers = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in walk(parsed(path)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.startswith("redis.exceptions") for n in names):
                speakers.append(path.name)
    assert sorted(speakers) == ["resp.py", "store.py"]


def test_the_call_token_wing_stands_alone():
    """The signer's wing imports only itself (and the verifier's distribution, which holds the token's
    shape; the package ``proxy`` holds only its version)."""
    graph = import_graph()
    outside = sorted(f"{m} imports {t}" for m, targets in graph.items() if m.startswith("proxy.calltokens")
                     for t in targets if not t.startswith("proxy.calltokens"))
    assert not outside
    assert not [n for n in walk(parsed(PACKAGE / "__init__.py")) if isinstance(n, (ast.Import, ast.ImportFrom))]


VERIFIER = PACKAGE.parent / "toolproxy_verifier"


def test_the_verifier_distribution_needs_only_what_it_declares():
    """``toolproxy-verifier`` (a backend team's install) imports the standard library, PyJWT, rfc8785 and,
    for its aiohttp middleware only, aiohttp: never the proxy or another of its dependencies."""
    import sys

    imported = set()
    for path in VERIFIER.rglob("*.py"):
        for node in walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                imported.add((node.module or "").partition(".")[0])
    outside = imported - set(sys.stdlib_module_names) - {"jwt", "rfc8785", "aiohttp"}
    assert not outside
    assert "jwt" in imported and "rfc8785" in imported


def test_the_readme_lists_the_wings_in_tier_order():
    """The README's map of the package, highest first, is the tier order this file enforces."""
    text = (REPO / "README.md").read_text()
    block = text[text.index("```\nproxy/authoring/"):]
    block = block[:block.index("\n```", 4)]
    listed = []
    for line in block.splitlines()[1:]:
        path = line.split()[0] if line.startswith("proxy/") else None
        if path:
            listed.append({"proxy/*.py": "core", "proxy/pipeline.py": "pipeline"}.get(path, path[6:].rstrip("/")))
    assert listed == TIERS[::-1]
