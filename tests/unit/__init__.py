"""Paths the unit tests read (the demo registry), without the stack helpers of ``tests/support``."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO_REGISTRY = REPO / "examples" / "registry"
