"""What a piece of code sends to a real Redis: top-level commands (MONITOR) and network round trips.

``async with RedisTraffic(url) as traffic: ...; seen = await traffic.since_start()`` gives the
top-level commands every client sent meanwhile — scripts named by ``proxy.store.SCRIPT_NAMES``
(``operations.begin``), other commands in lower case (``zrange``) — and the server's read events
(``INFO stats total_reads_processed``): a pipeline of several commands arrives as one. Commands a
script runs inside Redis (``[0 lua]``) are not counted, nor this helper's own INFO and ECHO.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import redis.asyncio as redis_async

from proxy.store import SCRIPT_NAMES
from tests.support.waits import wait_until


@dataclass(frozen=True)
class Seen:
    commands: list[str]
    round_trips: int


class RedisTraffic:
    def __init__(self, url: str) -> None:
        self._client = redis_async.Redis.from_url(url)
        self._lines: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None
        self._reads0 = 0

    async def __aenter__(self) -> "RedisTraffic":
        self._monitor = self._client.monitor()
        await self._monitor.__aenter__()  # MONITOR answered OK: it is on before anything is counted
        self._task = asyncio.create_task(self._listen())
        await self._marker()
        self._lines.clear()
        self._reads0 = await self._reads()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._monitor.__aexit__(*exc)
        await self._client.aclose()

    async def _listen(self) -> None:
        async for line in self._monitor.listen():
            self._lines.append(line)

    async def _reads(self) -> int:
        return int((await self._client.info("stats"))["total_reads_processed"])

    async def _marker(self) -> str:
        token = uuid.uuid4().hex
        await self._client.echo(token)
        await wait_until(lambda: any(line["command"] == f"ECHO {token}" for line in self._lines), timeout=10,
                         what="the MONITOR feed to catch up")
        return token

    async def since_start(self) -> Seen:
        """Everything since entering (or the previous call), once the MONITOR feed has caught up."""
        reads = await self._reads()
        await self._marker()
        lines, self._lines = self._lines, []
        commands = []
        for line in lines:
            if line.get("client_type") == "lua" or line["command"].split(" ", 1)[0].upper() in ("INFO", "ECHO"):
                continue
            words = line["command"].split(" ")
            name = words[0].lower()
            commands.append(SCRIPT_NAMES.get(words[1], f"evalsha {words[1]}") if name == "evalsha" else name)
        # Own traffic in the reads: the INFO just read (counted as it was read), minus the entering INFO.
        round_trips = reads - self._reads0 - 1
        self._reads0 = reads + 1  # the ECHO marker that followed
        return Seen(commands, round_trips)
