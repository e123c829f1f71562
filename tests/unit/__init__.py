"""Paths the unit tests read (the demo registry), without the stack helpers of ``tests/support``; ``parsed``,
the syntax tree of a source file, parsed once for every check that reads the package's source."""

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO_REGISTRY = REPO / "examples" / "registry"


@functools.cache
def parsed(path: Path) -> ast.Module:
    """``path``'s syntax tree (shared between the checks: they only read it)."""
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def setup_scripts() -> str:
    """``scripts/setup.sh`` and the tool families it sources (``scripts/setup/*.sh``), as one text."""
    paths = [REPO / "scripts" / "setup.sh", *sorted((REPO / "scripts" / "setup").glob("*.sh"))]
    return "\n".join(path.read_text(encoding="utf-8") for path in paths)
