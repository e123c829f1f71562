"""The token cache: tokens reused until shortly before they expire, each fetched once however many calls wait.

Owns: a bounded map of tokens by key (least recently used out first), when each stops being handed out (its
lifetime less ``refresh_before_s``, at most half of it), and single flight: one fetch per key at a time, which every
call that needs that key waits for within its own time (a call that gives up leaves the fetch to the others).
Must never: hand out a token past the time it was kept for, start a second fetch for a key while one runs, or keep
a failure (the next call asks again).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Awaitable, Callable, Hashable

from .token_endpoint import Token


class TokenCache:
    def __init__(self, *, refresh_before_s: float, max_entries: int) -> None:
        self._refresh_before_s = refresh_before_s
        self._max = max_entries
        self._tokens: collections.OrderedDict[Hashable, tuple[str, float]] = collections.OrderedDict()
        self._fetches: dict[Hashable, asyncio.Task[str]] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    async def get(self, key: Hashable, fetch: Callable[[], Awaitable[Token]], wait_s: float) -> str:
        """The token kept for ``key``, else the one ``fetch`` brings (shared with every caller of that key),
        waiting at most ``wait_s`` (TimeoutError after)."""
        loop = asyncio.get_running_loop()
        kept = self._tokens.get(key)
        if kept is not None:
            if loop.time() < kept[1]:
                self._tokens.move_to_end(key)
                return kept[0]
            del self._tokens[key]
        task = self._fetches.get(key)
        if task is None:
            task = self._fetches[key] = loop.create_task(self._fill(key, fetch))
            task.add_done_callback(_retrieve)
        async with asyncio.timeout(wait_s):
            return await asyncio.shield(task)

    async def _fill(self, key: Hashable, fetch: Callable[[], Awaitable[Token]]) -> str:
        try:
            token = await fetch()
        finally:
            self._fetches.pop(key, None)
        keep_s = token.lifetime_s - min(self._refresh_before_s, token.lifetime_s / 2)
        self._tokens[key] = (token.value, asyncio.get_running_loop().time() + keep_s)
        self._tokens.move_to_end(key)
        while len(self._tokens) > self._max:
            self._tokens.popitem(last=False)
        return token.value

    async def aclose(self) -> None:
        for task in list(self._fetches.values()):
            task.cancel()
        self._fetches.clear()
        self._tokens.clear()


def _retrieve(task: asyncio.Task[str]) -> None:
    """A fetch every waiter gave up on still ends somewhere: its error is read here (asyncio would log it)."""
    if not task.cancelled():
        task.exception()
