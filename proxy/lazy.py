"""Imports a deployment may not use, made on first use: the one pattern for them.

Owns: ``OnFirstUse(build)``, an object built (its module imported inside ``build``) the first time it is
needed, once; ``warm()`` builds it ahead of time where the first caller must not pay for the import.
Used for the MCP SDK (its client machinery only when a tool's backend is an MCP upstream: the MCP adapter
in ``proxy/process/runtime.py``; its server side only when ``mcp.front`` is on: ``proxy/fronts/app.py``). Anything
optional with a heavy import does the same (e.g. OpenTelemetry only when tracing is configured):

    tracer = OnFirstUse(lambda: _build_tracer(config))  # _build_tracer does ``from opentelemetry import ...``
    if config.tracing.enabled:
        tracer.warm()                                      # configured: imported at start-up, not by a call

and ``tests/test_lazy_imports.py`` asserts that a process without that configuration never imports
it (a fresh interpreter, ``sys.modules``). Must never: import anything but the standard library at module
level, or hide a failed import or build (the first use raises it, and the next use tries again).
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class OnFirstUse(Generic[T]):
    """``build()`` run once, on the first ``get()`` (or ``warm()``); its result kept."""

    def __init__(self, build: Callable[[], T]) -> None:
        self._build: Callable[[], T] | None = build
        self._value: T | None = None
        self._lock = threading.Lock()  # a build from a thread (a warm-up) and one from the loop: one build

    def get(self) -> T:
        if self._build is None:
            return self._value  # type: ignore[return-value]  # built: the fast path takes no lock
        with self._lock:
            if self._build is not None:
                self._value = self._build()
                self._build = None
        return self._value  # type: ignore[return-value]

    def warm(self) -> T:
        """Build now (start-up), so that no caller's first use pays for it."""
        return self.get()

    @property
    def built(self) -> T | None:
        """The object if it was built, else None (closing what was never opened is nothing to do)."""
        return self._value if self._build is None else None
