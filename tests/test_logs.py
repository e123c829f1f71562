"""Log lines: structured, carrying the request context, with credentials scrubbed."""

from __future__ import annotations

import io
import json
import logging

import pytest

from proxy.telemetry import logs


@pytest.fixture
def capture():
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)

    def install(fmt: str) -> io.StringIO:
        logs.configure("debug", fmt, stream)
        return stream
    yield install
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_json_lines_carry_the_bound_request_context(capture):
    stream = capture("json")
    log = logging.getLogger("toolproxy.test")
    with logs.bound(request_id="req-1", trace_id="ab" * 16):
        with logs.bound(call_id="call-1"):
            log.info("inside %s", "call")
        log.info("after call")
    log.info("outside")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(l["msg"], l.get("request_id"), l.get("call_id")) for l in lines] == [
        ("inside call", "req-1", "call-1"), ("after call", "req-1", None), ("outside", None, None)]
    assert lines[0]["trace_id"] == "ab" * 16 and lines[0]["level"] == "info"


def test_credentials_in_messages_are_scrubbed(capture):
    stream = capture("kv")
    log = logging.getLogger("toolproxy.test")
    log.warning("headers Authorization: Bearer abc.def.ghi cookie=sess-123 password=hunter2 "
                "jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.sig api_key: K-999")
    text = stream.getvalue()
    for secret in ("abc.def.ghi", "sess-123", "hunter2", "eyJzdWIiOiJ4In0", "K-999"):
        assert secret not in text
    assert text.startswith("time=") and "level=warning" in text


def test_exceptions_are_logged_as_type_and_location_never_message(capture):
    stream = capture("json")
    try:
        {"password": "x"}["card-4111-1111"]
    except KeyError:
        logging.getLogger("toolproxy.test").exception("lookup failed")
    line = json.loads(stream.getvalue())
    assert line["error"]["type"] == "KeyError"
    assert any("test_logs.py" in frame for frame in line["error"]["at"])
    assert "card-4111" not in stream.getvalue() and "Traceback" not in stream.getvalue()


def test_unknown_format_is_refused():
    with pytest.raises(ValueError):
        logs.configure("info", "xml")



@pytest.mark.parametrize("name,value,expected", [
    ("TOOLPROXY_AUDIT_ON_FAILURE_WRITE", "sometimes", "audit.on_failure_write"),
    ("TOOLPROXY_AUDIT_SINKS", "kafka", "audit.sinks"),
    ("TOOLPROXY_LOG_FORMAT", "xml", "log.format"),
])
def test_run_refuses_a_bad_audit_or_log_setting_before_listening(monkeypatch, capsys, name, value, expected):
    from proxy.cli import main
    monkeypatch.setenv(name, value)
    assert main(["run"]) == 1
    assert expected in capsys.readouterr().err
