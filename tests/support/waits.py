"""Bounded polling for tests: wait for a condition, never sleep "to let things settle"."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable


async def wait_until(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition",
                     interval: float = 0.005) -> None:
    """Poll ``predicate`` (sync or async) until it is truthy; fail the test after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() >= end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(interval)
