"""Deadlines: the caller's absolute deadline and the budget left for each step.

Owns: parsing ``X-Request-Deadline`` (epoch milliseconds) and
``Request-Timeout`` (seconds) into a monotonic-clock deadline, and computing
budget = min(tool timeout, deadline - now - margin). Must never: use the wall
clock for anything but converting the caller's absolute deadline once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from .errors import ProxyError

Clock = Callable[[], float]


@dataclass(frozen=True)
class Deadline:
    """An absolute deadline on the monotonic clock (None = the caller set none)."""

    at: float | None
    clock: Clock = time.monotonic

    def remaining(self) -> float | None:
        if self.at is None:
            return None
        return max(0.0, self.at - self.clock())

    def remaining_ms(self) -> int | None:
        """Whole milliseconds left (``timing.deadline_ms`` of an envelope), None without a deadline."""
        remaining = self.remaining()
        return None if remaining is None else int(remaining * 1000)

    def budget(self, tool_timeout_s: float, margin_s: float) -> float:
        """Seconds this step may take; <= 0 means no budget is left."""
        remaining = self.remaining()
        if remaining is None:
            return tool_timeout_s
        return min(tool_timeout_s, remaining - margin_s)

    def earliest(self, other: "Deadline") -> "Deadline":
        candidates = [d for d in (self.at, other.at) if d is not None]
        return Deadline(min(candidates) if candidates else None, self.clock)


def from_headers(headers: Mapping[str, str], *, max_timeout_s: float,
                 clock: Clock = time.monotonic, wall: Clock = time.time) -> Deadline:
    """Build the caller's deadline; the earlier of the two headers wins."""
    now_mono = clock()
    candidates: list[float] = []
    absolute = headers.get("X-Request-Deadline")
    if absolute is not None:
        ms = _number(absolute, "X-Request-Deadline")
        candidates.append(now_mono + (ms / 1000.0 - wall()))
    relative = headers.get("Request-Timeout")
    if relative is not None:
        seconds = _number(relative, "Request-Timeout")
        if seconds < 0:
            raise ProxyError("invalid_request", "Request-Timeout must not be negative",
                             details={"header": "Request-Timeout"}, phase="request")
        candidates.append(now_mono + seconds)
    if not candidates:
        return Deadline(None, clock)
    at = min(min(candidates), now_mono + max_timeout_s)
    return Deadline(at, clock)


def _number(raw: str, header: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ProxyError("invalid_request", f"{header} must be a number",
                         details={"header": header}, phase="request")
    return value
