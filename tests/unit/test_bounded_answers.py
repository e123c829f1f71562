"""Every answer an MCP upstream sends is bounded before it reaches the proxy's memory
(proxy/adapters/bounded_answers.py): ``httpx2``'s own in-process transport plays an upstream that sends too
much, or a compressed body, and the bounded transport in front of it cuts the answer."""

from __future__ import annotations

import gzip

import httpx2
import pytest

from proxy.adapters.bounded_answers import AnswerRefused, BoundedTransport


def upstream(body: bytes | list[bytes], headers: dict[str, str] | None = None, seen: list | None = None):
    """An upstream streaming ``body`` (a list: as that many chunks), recording each request. (A body given
    as bytes would be read whole by ``httpx2.Response`` before any transport could bound it; a real
    upstream's answer is a stream.)"""

    async def chunks():
        for chunk in body if isinstance(body, list) else [body]:
            yield chunk

    def answer(request: httpx2.Request) -> httpx2.Response:
        if seen is not None:
            seen.append(request)
        return httpx2.Response(200, headers=headers or {}, content=chunks())

    return httpx2.MockTransport(answer)


async def fetch(transport: BoundedTransport) -> bytes:
    async with httpx2.AsyncClient(transport=transport) as client:
        return (await client.get("http://upstream.test/mcp", headers={"Accept-Encoding": "gzip"})).content


async def test_an_answer_within_the_limit_passes_whole_and_identity_is_asked_for():
    seen: list[httpx2.Request] = []
    assert await fetch(BoundedTransport(upstream(b"x" * 100, seen=seen), max_bytes=100)) == b"x" * 100
    assert seen[0].headers["Accept-Encoding"] == "identity"  # the caller's gzip is replaced


@pytest.mark.parametrize("body", [b"x" * 101, [b"x" * 60, b"x" * 41]], ids=["one body", "chunks together"])
async def test_an_answer_past_the_limit_is_cut_and_the_caller_hears_why(body):
    heard: list[AnswerRefused] = []
    with pytest.raises(AnswerRefused) as refused:
        await fetch(BoundedTransport(upstream(body), max_bytes=100, on_refused=heard.append))
    assert (refused.value.what, refused.value.limit) == ("body", 100)
    assert heard == [refused.value]
    assert isinstance(refused.value, httpx2.ReadError)  # the SDK handles it as a lost connection


async def test_an_encoded_answer_is_refused_undecoded():
    bomb = gzip.compress(b"\0" * 1_000_000)  # inflates far past the limit; never inflated here
    heard: list[AnswerRefused] = []
    with pytest.raises(AnswerRefused) as refused:
        await fetch(BoundedTransport(upstream(bomb, {"Content-Encoding": "gzip"}), max_bytes=len(bomb) * 10,
                                     on_refused=heard.append))
    assert refused.value.what == "content_encoding" and heard == [refused.value]


async def test_identity_said_out_loud_is_not_an_encoding():
    transport = BoundedTransport(upstream(b"ok", {"Content-Encoding": " Identity "}), max_bytes=10)
    assert await fetch(transport) == b"ok"
