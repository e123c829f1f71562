"""The packed form of an operation record's texts (proxy/record_text.py): smaller, read back exactly, earlier
records read as they were, and nothing a Redis writer plants inflates beyond the bound."""

from __future__ import annotations

import hashlib
import json
import zlib

import pytest

from proxy.record_text import DICTIONARY_V1, PACKED_MAX_BYTES, PackedTextError, pack, unpack

META = json.dumps({"agent": "dev-agent", "call_id": "call_1", "marks": True,
                   "request_id": "e8ea11f9b78d4f5dbaf4e7a63e4c320e", "source": "idempotency_key",
                   "subject": "dev-user", "target": {"arguments": {"counter": "ctr_size", "delta": 1},
                                                     "resources": ["counter:ctr_size"]},
                   "tool": "adjust_counter", "tool_version": "1.0.0",
                   "traceparent": "00-12d1f2b9d21c3dc27408f69b0a09ca25-74a3e3d25c810f1f-01"},
                  separators=(",", ":"), sort_keys=True)


def deflated(data: bytes, version: int = 1) -> bytes:
    deflate = zlib.compressobj(6, zlib.DEFLATED, -11, 6, zdict=DICTIONARY_V1)
    return bytes((0xFF, version)) + deflate.compress(data) + deflate.flush()


def test_a_meta_packs_to_well_under_half_and_reads_back_exactly():
    packed = pack(META)
    assert isinstance(packed, bytes) and packed[:2] == b"\xff\x01"
    assert len(packed) < 0.45 * len(META), (len(packed), len(META))
    assert unpack(packed) == META


def test_texts_that_would_not_shrink_or_are_past_the_bound_are_stored_as_written():
    assert pack("") == "" and pack("1") == "1" and pack('{"a":1}') == '{"a":1}'
    large = json.dumps({"data": "x" * PACKED_MAX_BYTES})
    assert pack(large) == large and unpack(large.encode()) == large


def test_an_earlier_records_plain_text_reads_as_it_was():
    assert unpack(META.encode()) == META and unpack("héllo".encode()) == "héllo"


@pytest.mark.parametrize("planted", [
    deflated(b"{" + b" " * (PACKED_MAX_BYTES + 1)),     # inflates past the bound (a bomb, small in Redis)
    deflated(b"\x00" * 10_000_000),                     # ten megabytes of zeros in about ten kilobytes
    deflated(META.encode())[:-3],                       # cut short
    deflated(META.encode(), version=2),                 # a dictionary this version does not know
    b"\xff",                                            # the mark alone
    b"\xff\x01not deflate at all",
    deflated("é".encode("latin-1")),                    # inflates to bytes that are not UTF-8
    b"\xc3\x28",                                        # not UTF-8, not packed
])
def test_what_this_proxy_did_not_write_is_refused_never_inflated_past_the_bound(planted):
    assert len(planted) < 20_000
    with pytest.raises(PackedTextError):
        unpack(planted)


def test_the_dictionary_of_version_1_never_changes():
    """A record packed with it must stay readable for its whole retention: a new vocabulary is version 2."""
    pinned = "b1180e344e48d8e28eebfee546bf2da70d2c19bb0a0a5c6d01586d6ce5c114f4"
    assert hashlib.sha256(DICTIONARY_V1).hexdigest() == pinned
