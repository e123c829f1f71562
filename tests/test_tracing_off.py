"""A deployment without tracing never loads the OpenTelemetry SDK or its exporter, and an endpoint turns both
on (``proxy/telemetry/tracing.py``, ``proxy/telemetry/spans.py``). The check runs in a fresh interpreter and
reads its ``sys.modules``; the settings, the propagator and the span attributes are
tests/unit/test_tracing.py's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.unit import REPO

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_tracing_is_off_by_default_and_the_sdk_is_never_imported():
    """A deployment without tracing imports every module, serves a traced request's headers and never loads
    the OpenTelemetry SDK or its exporter (start-up time and memory, #32); an endpoint turns both on."""
    script = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        import proxy
        for module in pkgutil.walk_packages(proxy.__path__, "proxy."):
            importlib.import_module(module.name)
        from proxy.config import load_config
        from proxy.telemetry import spans, tracing
        config = load_config(env={{}})
        assert not config.tracing.enabled
        assert spans.configure(config.tracing) is None
        found = tracing.accept({{"traceparent": "{PARENT}", "tracestate": "a=b"}})
        assert found.remote and found.tracestate == "a=b"
        # (redis-py 8 imports opentelemetry.sdk.metrics for its own optional metrics whenever the SDK is
        # installed; the tracing SDK and the exporter are ours to keep out)
        loaded = sorted(m for m in sys.modules
                        if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter", "opentelemetry.proto",
                                         "google.protobuf")))
        assert not loaded, loaded
        on = spans.configure(load_config(env={{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                                               "OTEL_BSP_SCHEDULE_DELAY": "60000"}}).tracing)
        assert on is not None and "opentelemetry.sdk.trace" in sys.modules
        spans.shutdown()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
