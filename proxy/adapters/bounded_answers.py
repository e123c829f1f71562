"""Every answer an MCP upstream sends over ``httpx2``, bounded in the bytes that reach the proxy's memory.

Owns: the transport both of the proxy's ``httpx2`` clients of MCP upstreams sit on (the adapter's SDK
sessions and the pin watcher's): it asks for no content coding (``Accept-Encoding: identity``), refuses an
answer that is encoded all the same (a 40 KB gzip body inflates to 40 MiB and more before any count of
decoded bytes sees it, so an encoded answer is never decoded), and cuts an answer past ``max_bytes`` (the
body, or every event of an SSE stream together) with ``AnswerRefused``, a read error the SDK handles as a
lost connection; ``on_refused`` hears why first, so the caller can name the limit.

Must never: decode a compressed body, or hold more than ``max_bytes`` of one answer.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

import httpx2

IDENTITY = "identity"


class AnswerRefused(httpx2.ReadError):
    """An upstream's answer was cut: ``what`` is ``body`` (past ``limit`` bytes) or ``content_encoding``."""

    def __init__(self, what: str, limit: int) -> None:
        super().__init__(f"answer refused: {what}")
        self.what, self.limit = what, limit


Refusal = Callable[[AnswerRefused], None]


class _Capped(httpx2.AsyncByteStream):
    def __init__(self, inner: Any, max_bytes: int, refused: Callable[[AnswerRefused], AnswerRefused]) -> None:
        self._inner = inner
        self._max = max_bytes
        self._refused = refused

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        async for chunk in self._inner:
            seen += len(chunk)
            if seen > self._max:
                raise self._refused(AnswerRefused("body", self._max))
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class BoundedTransport(httpx2.AsyncBaseTransport):
    """``inner`` (an ``httpx2`` transport), with every answer bounded (module docstring)."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, max_bytes: int,
                 on_refused: Refusal | None = None) -> None:
        self._inner = inner
        self._max = max_bytes
        self._on_refused = on_refused

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        request.headers["Accept-Encoding"] = IDENTITY
        response = await self._inner.handle_async_request(request)
        coding = response.headers.get("Content-Encoding", IDENTITY).strip().lower()
        if coding != IDENTITY:
            await response.aclose()
            raise self._refused(AnswerRefused("content_encoding", self._max))
        response.stream = _Capped(response.stream, self._max, self._refused)
        return response

    def _refused(self, error: AnswerRefused) -> AnswerRefused:
        if self._on_refused is not None:
            self._on_refused(error)
        return error

    async def aclose(self) -> None:
        await self._inner.aclose()
