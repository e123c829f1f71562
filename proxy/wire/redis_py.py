"""redis-py, first imported without OpenTelemetry's metrics SDK (a sidecar's start-up).

Owns: the process's first import of redis-py. redis-py 8.1 tries ``from opentelemetry.sdk.metrics import
MeterProvider`` when ``redis/observability/providers.py`` is imported (from ``redis.connection`` through
``redis.maint_notifications``, so by any ``import redis``), only to set a flag (``OTEL_AVAILABLE``) and a type
annotation: its own metrics, when an application turns them on, reach the global meter provider through the
OpenTelemetry API (``opentelemetry.metrics``), never through that name. The SDK is installed for toolproxy's
traces, which use ``opentelemetry.sdk.trace`` and never ``opentelemetry.sdk.metrics``; importing the metrics
half cost every start 60-120 ms and 1.7 MB. So while redis-py is first imported, that one module is
unimportable (``sys.modules[name] = None``: importing it raises ``ImportError``, as if it were not installed),
and right after it is importable again: whatever imports it later gets it as usual.

Every module of the package that imports redis-py imports this module first (``proxy/wire/resp.py``,
``proxy/store.py``, ``proxy/authoring/policy_replay.py``). redis-py is pinned exactly in pyproject.toml, and
``tests/test_redis_import.py`` fails when the block stops working, when redis-py's flag no longer reads
it, or when a serving process imports redis-py before this module.

Must never: block any other module, leave the block in place after redis-py is imported, block when the metrics
SDK is already imported (someone uses it: redis-py then sees it as usual), or run from a thread other than
the one importing the package at start-up (another thread importing the SDK meanwhile would see it missing).
"""

from __future__ import annotations

import importlib
import sys

# The one module made unimportable while redis-py is first imported.
OTEL_METRICS_SDK = "opentelemetry.sdk.metrics"


def _import_redis_without_the_metrics_sdk() -> bool:
    """Import redis-py (and its asyncio client) with ``OTEL_METRICS_SDK`` unimportable; True when it was."""
    if "redis" in sys.modules or OTEL_METRICS_SDK in sys.modules:
        return False  # imported before, or the SDK's metrics are in use: nothing to spare, nothing to hide
    sys.modules[OTEL_METRICS_SDK] = None  # type: ignore[assignment]  # the import system's "not importable"
    try:
        importlib.import_module("redis.asyncio")  # and with it redis itself
    finally:
        if OTEL_METRICS_SDK in sys.modules and sys.modules[OTEL_METRICS_SDK] is None:
            del sys.modules[OTEL_METRICS_SDK]
    return True


# Whether this process's first import of redis-py was the one made here (tests read it).
BLOCKED_ON_FIRST_IMPORT = _import_redis_without_the_metrics_sdk()
