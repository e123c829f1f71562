"""Tracing without a trace backend: the settings and the standard OTEL_* variables, the W3C propagator at the
ingress, the SDK imported only when tracing is on, and what a span may say (proxy/telemetry/tracing.py,
proxy/telemetry/spans.py). The spans a real backend receives are tests/test_traces.py's;
that an untraced process never imports the SDK is tests/test_tracing_off.py's (a fresh interpreter)."""

from __future__ import annotations

import pytest

from proxy.config import ConfigError, load_config
from proxy.telemetry import spans, tracing

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_the_standard_otel_variables_set_the_tracing_section_and_toolproxy_settings_win():
    config = load_config(env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/", "OTEL_SERVICE_NAME": "sidecar-a",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on", "OTEL_TRACES_SAMPLER_ARG": "0.5",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,k8s.pod.name=p%2D1",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-api-key=abc", "OTEL_BSP_MAX_QUEUE_SIZE": "100",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "50", "TOOLPROXY_TRACING_SERVICE_NAME": "sidecar-b"})
    t = config.tracing
    assert t.enabled and t.spans_url == "http://collector:4318/v1/traces"
    assert t.service_name == "sidecar-b"  # TOOLPROXY_* over OTEL_*
    assert t.sampler == "parentbased_always_on" and t.sampler_arg == 0.5
    assert t.resource_attributes == {"deployment.environment": "prod", "k8s.pod.name": "p-1"}
    assert t.headers == {"x-api-key": "abc"} and t.max_queue_size == 100
    assert load_config(env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/custom"}).tracing.spans_url \
        == "http://c:4318/custom"


@pytest.mark.parametrize("switch", [{"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}])
def test_the_standard_switches_turn_tracing_off(switch):
    assert not load_config(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", **switch}).tracing.enabled


@pytest.mark.parametrize("env, named", [
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "tracing.sampler"),
    ({"OTEL_TRACES_SAMPLER_ARG": "2"}, "tracing.sampler_arg"),
    ({"OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "tracing.endpoint"),
    ({"TOOLPROXY_TRACING_MAX_QUEUE_SIZE": "0"}, "tracing.max_queue_size"),
])
def test_a_bad_tracing_setting_stops_the_process_naming_it(env, named):
    with pytest.raises(ConfigError) as caught:
        load_config(env=env)
    assert named in str(caught.value)


def test_the_propagator_honours_a_valid_traceparent_and_its_tracestate():
    found = tracing.accept({"traceparent": PARENT, "tracestate": "vendor=opaque,b=2"})
    assert (found.trace_id, found.parent_id, found.flags, found.remote) == (
        "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", "01", True)
    assert found.tracestate == "vendor=opaque,b=2"
    child = found.child()
    assert child.trace_id == found.trace_id and child.parent_id != found.parent_id
    assert child.headers() == {"traceparent": child.traceparent, "tracestate": "vendor=opaque,b=2"}


@pytest.mark.parametrize("header", [
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # all-zero trace id
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # all-zero parent
    "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # forbidden version
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",     # no flags
    "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01\r\nx: y",
    "garbage",
])
def test_a_malformed_traceparent_starts_a_new_trace_and_drops_the_tracestate(header):
    found = tracing.accept({"traceparent": header, "tracestate": "vendor=opaque"})
    assert not found.remote and found.tracestate is None
    assert found.trace_id != "0af7651916cd43dd8448eb211c80319c" and len(found.trace_id) == 32
    assert found.headers() == {"traceparent": found.traceparent}


def test_attribute_values_follow_the_audit_rules():
    assert spans.safe_value("toolproxy.api_key", "abc") == "[redacted]"
    assert "hunter2" not in spans.safe_value("note", "password=hunter2 and Bearer abc.def")
    assert spans.safe_value("x", "y" * 1000).endswith("...[truncated]")
    assert spans.reason_ids(["tool_denied:order:42", "limit"]) == ["tool_denied", "limit"]
    assert len(spans.key_hash("tenant-key-123")) == 32 and "tenant" not in spans.key_hash("tenant-key-123")


@pytest.mark.parametrize("sampler", ["parentbased_traceidratio", "traceidratio", "parentbased_always_on",
                                     "parentbased_always_off", "always_on", "always_off"])
def test_a_call_the_sampler_drops_is_dropped_before_any_span_exactly_as_the_sdk_decides(sampler):
    """``Tracing._drops`` (no span built for most calls at the default sampler) never disagrees with the SDK's
    own sampler: over random trace ids, remote parents sampled and not, it drops only what the SDK drops."""
    import random

    from opentelemetry.sdk.trace.sampling import Decision
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    config = load_config(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_BSP_SCHEDULE_DELAY": "60000",
                              "OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": "0.25"}).tracing
    on = spans.Tracing(config)
    try:
        rng = random.Random(7)
        dropped = 0
        for i in range(2000):
            trace_id, remote, flags = f"{rng.getrandbits(128):032x}", i % 3 == 0, rng.choice(["00", "01"])
            trace = tracing.TraceContext(trace_id, f"{rng.getrandbits(64):016x}", flags, "", remote)
            parent = None
            if remote:
                parent = set_span_in_context(NonRecordingSpan(SpanContext(
                    int(trace_id, 16), int(trace.parent_id, 16), is_remote=True, trace_flags=TraceFlags(int(flags, 16)))))
            verdict = on.provider.sampler.should_sample(parent, int(trace_id, 16), "execute_tool").decision
            if on._drops(trace):
                dropped += 1
                assert verdict == Decision.DROP, (sampler, trace)
        assert dropped > 0 or sampler in ("always_on", "parentbased_always_on")
    finally:
        on.shutdown()
