"""The packed form of an operation record's JSON texts (its meta and its outcome) in Redis.

Owns: deflating a record's meta and outcome with a preset dictionary of the record's own vocabulary (the
names the proxy writes, not any tenant's data) when that makes them smaller, and reading either form back
to the JSON text it was (a record's bytes are paid once per write across the fleet, for its
whole retention; a 370-byte meta deflates to about 150 bytes, where deflate without the dictionary only
reaches 240).

A packed text is ``\\xff``, the dictionary's version (one byte), then raw deflate (a 2 KiB window).
``\\xff`` never starts UTF-8 text, so a stored value is either form and every earlier record (plain JSON)
reads as it did. Only texts up to ``PACKED_MAX_BYTES`` are packed, and a packed text that inflates beyond
that bound is refused: a Redis writer cannot plant a small value that inflates into the proxy's memory (a
deflate stream can expand about 1,000-fold).

Must never: change ``DICTIONARY_V1`` (a record written with it could no longer be read; a new vocabulary
is a new version byte beside it), pack a text the MAC covers in place of the text (the record MAC is over
the JSON text: ``operations``), or decide what a text means.
"""

from __future__ import annotations

import zlib

PACKED = 0xFF
PACKED_MAX_BYTES = 65536  # larger texts are stored as written; a packed one never inflates beyond it
# Level 6, a 2 KiB window and memLevel 6: a meta packs in about 16 us and to the same bytes as level 9 with
# zlib's default 32 KiB window and memLevel 8, which cost about 95 us (setting up 384 KiB of state per text:
# 8% of a write's CPU for its two texts). The dictionary fits the window.
_LEVEL, _WINDOW_BITS, _MEM_LEVEL = 6, 11, 6

# The record's vocabulary, rarest first: deflate reaches nearer strings with fewer bits. Names and shapes
# only (``idempotency.record_meta``, ``idempotency.stored_outcome``, the executors' evidence, errors).
DICTIONARY_V1 = (
    b'"partial":{"committed":[],"pending":[]},"compensation_inputs":{},"observed":"","at_ms":,'
    b'"error":{"code":"","message":"","retryable":false,"attempted":true,"details":{}},'
    b'"side_effect":{"attempted":true,"committed":true,"summary":""},"result_digest":"",'
    b'"resource_keys":[],"source":"executor","status":"","id":"","name":"","value":,"count":'
    b'{"agent":"","call_id":"call_","marks":true,"request_id":"","source":"idempotency_key","subject":"",'
    b'"target":{"arguments":{},"resources":[]},"tool":"","tool_version":"1.0.0",'
    b'"traceparent":"00--01"}'
    b'{"data":{},"evidence":{"backend_request_id":"","server_time":"T00:00:00.000Z"},"~":""}'
)
_DICTIONARIES = {1: DICTIONARY_V1}
_WRITTEN = 1


class PackedTextError(ValueError):
    """A packed text that does not inflate to a text this proxy writes (foreign or damaged)."""


def pack(text: str) -> bytes | str:
    """What a record stores for ``text``: its packed form when that is smaller, else ``text`` itself."""
    data = text.encode()
    if not data or len(data) > PACKED_MAX_BYTES:
        return text
    deflate = zlib.compressobj(_LEVEL, zlib.DEFLATED, -_WINDOW_BITS, _MEM_LEVEL, zdict=_DICTIONARIES[_WRITTEN])
    packed = bytes((PACKED, _WRITTEN)) + deflate.compress(data) + deflate.flush()
    return packed if len(packed) < len(data) else text


def is_packed(data: bytes) -> bool:
    return data[:1] == bytes((PACKED,))


def unpack(data: bytes) -> str:
    """The JSON text a stored value holds (packed or not); PackedTextError if it is neither."""
    if not is_packed(data):
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise PackedTextError("operation record: a text that is not UTF-8") from None
    dictionary = _DICTIONARIES.get(data[1]) if len(data) > 1 else None
    if dictionary is None:
        raise PackedTextError("operation record: a packed text of an unknown version")
    inflate = zlib.decompressobj(-_WINDOW_BITS, zdict=dictionary)
    try:
        text = inflate.decompress(data[2:], PACKED_MAX_BYTES + 1)
        if not inflate.eof or inflate.unconsumed_tail or len(text) > PACKED_MAX_BYTES:
            raise PackedTextError("operation record: a packed text that does not end within its bound")
        return text.decode()
    except (zlib.error, UnicodeDecodeError):
        raise PackedTextError("operation record: a packed text that does not inflate") from None
