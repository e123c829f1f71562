"""Paths the unit tests read (the demo registry), without the stack helpers of ``tests/support``; ``parsed``,
the syntax tree of a source file, parsed once for every check that reads the package's source, and ``walk``,
its nodes listed once; ``load_yaml`` and ``dump_yaml``, a YAML file read by libyaml and written as JSON."""

import ast
import functools
import json
from pathlib import Path
from typing import Any, Iterable

import yaml

REPO = Path(__file__).resolve().parents[2]
DEMO_REGISTRY = REPO / "examples" / "registry"


@functools.cache
def parsed(path: Path) -> ast.Module:
    """``path``'s syntax tree (shared between the checks: they only read it)."""
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


_WALKED: dict[int, tuple[ast.Module, tuple[ast.AST, ...]]] = {}


def walk(tree: ast.AST) -> Iterable[ast.AST]:
    """``ast.walk(tree)``; a whole module's nodes are listed once and kept (ten checks walk every module of
    the package, and ``ast.walk`` costs more than the checks themselves)."""
    if not isinstance(tree, ast.Module):
        return ast.walk(tree)
    hit = _WALKED.get(id(tree))
    if hit is None or hit[0] is not tree:
        hit = _WALKED[id(tree)] = (tree, tuple(ast.walk(tree)))
    return hit[1]


def load_yaml(path: Path) -> Any:
    """``path`` read as the proxy reads a registry: safe, with libyaml (the pure-Python parser takes ten
    times as long)."""
    return yaml.load(path.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)  # noqa: S506 (a safe loader)


def dump_yaml(document: Any, *, sort_keys: bool = True) -> str:
    """``document`` as a YAML file's text, written as JSON (which YAML reads as it is): the registry checks
    read it like any other, and even libyaml's emitter takes 25 times as long."""
    return json.dumps(document, sort_keys=sort_keys, indent=1)


def setup_scripts() -> str:
    """``scripts/setup.sh`` and the tool families it sources (``scripts/setup/*.sh``), as one text."""
    paths = [REPO / "scripts" / "setup.sh", *sorted((REPO / "scripts" / "setup").glob("*.sh"))]
    return "\n".join(path.read_text(encoding="utf-8") for path in paths)
