"""The key=value log format cannot be forged: a value with CR, LF, any other control character, a Unicode line
separator, a space, a quote or an equals sign is written as one quoted JSON string with those escaped."""

from __future__ import annotations

import io
import json
import logging

import pytest

from proxy.telemetry.logs import KeyValueFormatter, kv_value

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text", ["a\rlevel=error", "a\nlevel=error", "tab\there", "nul\x00", "del\x7f",
                                  "nel\x85", "ls\u2028ps\u2029", "bell\x07", "esc\x1b[31m", "a b", 'q"', "k=v", ""])
def test_an_unsafe_value_is_one_quoted_json_string_with_no_raw_control_character(text):
    written = kv_value(text)
    assert written.startswith('"') and json.loads(written) == text
    assert not any(ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f or c in "\u2028\u2029" for c in written)


@pytest.mark.parametrize("text", ["plain", "req_0123", "ünïcödé", "a.b:c-d"])
def test_a_safe_value_stays_bare(text):
    assert kv_value(text) == text


def test_a_message_with_a_carriage_return_stays_on_one_line():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(KeyValueFormatter())
    logger = logging.getLogger("toolproxy.test.kv")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("tool %s failed", "x\r\nlevel=info msg=forged")
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "\r" not in stream.getvalue().rstrip("\n")
    assert 'msg="tool x\\r\\nlevel=info msg=forged failed"' in lines[0]
