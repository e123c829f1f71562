"""The process's event loop: uvloop where it is installed, else asyncio's own.

Owns: choosing and running the loop of ``toolproxy run`` and ``toolproxy dev``.
Must never: know what runs on it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop where it is installed (it is a dependency on Linux and macOS), else asyncio's
    own loop: the same semantics, less interpreter time per socket event."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop wheels
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
