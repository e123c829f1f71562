"""``mcp_wire._EventFeed``: SSE lines end at CR, LF or CRLF (also split across chunks), and a stream's bytes
and events before its result are bounded (``AnswerTooLarge``), whatever the upstream sends."""

from __future__ import annotations

import json

import pytest

from proxy.wire.mcp import AnswerTooLarge, Limits, _EventFeed

pytestmark = pytest.mark.unit

RESULT = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"content": [], "isError": False}}).encode()
NOTE = json.dumps({"jsonrpc": "2.0", "method": "notifications/progress",
                   "params": {"progressToken": 1, "progress": 1}}).encode()


def read(chunks, limits=Limits()):
    feed = _EventFeed(limits)
    for chunk in chunks:
        answer = feed.feed(chunk)
        if answer is not None:
            return answer
    return None


@pytest.mark.parametrize("eol", [b"\n", b"\r", b"\r\n"])
def test_every_line_ending_of_the_spec_ends_a_line(eol):
    stream = b"event: message" + eol + b"data: " + NOTE + eol + eol + b": ping" + eol + eol + \
        b"data: " + RESULT + eol + eol
    assert read([stream]) == {"content": [], "isError": False}
    assert read([bytes([b]) for b in stream]) == {"content": [], "isError": False}  # one byte at a time


def test_a_crlf_split_across_chunks_is_one_line_end_not_two():
    # Were the LF after a chunk's final CR a second line end, "data" would be dispatched early, without "id".
    first = b'data: {"jsonrpc": "2.0",\r'
    second = b'\ndata: "id": 1, "result": {"content": [], "isError": false}}\r\n\r\n'
    assert read([first, second]) == {"content": [], "isError": False}


def test_a_stream_of_notifications_is_cut_at_its_event_limit():
    feed = _EventFeed(Limits(max_bytes=1 << 30, max_events=100))
    with pytest.raises(AnswerTooLarge) as cut:
        for _ in range(1000):
            feed.feed(b"data: " + NOTE + b"\n\n")
    assert (cut.value.what, cut.value.limit, feed._events) == ("stream_events", 100, 101)


def test_a_stream_is_cut_at_its_byte_limit_even_without_a_line_end():
    feed = _EventFeed(Limits(max_bytes=64 * 1024, max_events=10))
    with pytest.raises(AnswerTooLarge) as cut:
        for _ in range(100):
            feed.feed(b": " + b"x" * 4096)  # one endless comment line
    assert cut.value.what == "stream_bytes" and feed._bytes <= 64 * 1024 + 4098


def test_pings_count_as_events():
    with pytest.raises(AnswerTooLarge):
        read([b": ping\r\n\r\n"] * 11 + [b"data: " + RESULT + b"\n\n"], Limits(max_events=10))
    assert read([b": ping\r\n\r\n"] * 9 + [b"data: " + RESULT + b"\n\n"], Limits(max_events=10)) is not None
