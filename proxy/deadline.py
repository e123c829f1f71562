"""Deadlines: the one time limit of a call, set once at ingress and asked by every step down to the wire.

Owns: parsing ``X-Request-Deadline`` (epoch milliseconds) and
``Request-Timeout`` (seconds) into a monotonic-clock ``Deadline`` that carries
the margin kept back for replying (``deadline.margin_ms``), and every piece of
deadline arithmetic: the budget of a step (min(its own cap, what is left minus
the margin)), the step's own absolute deadline handed to an adapter, and the
seconds a wire's timeout gets. A front builds the value once; the pipeline,
its stages and the adapters only ask it, so the limit never changes form
(absolute, then seconds, then absolute again) on its way to the backend.
Must never: use the wall clock for anything but converting the caller's
absolute deadline once; let another module hold a margin of its own.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from .errors import ProxyError

Clock = Callable[[], float]


@dataclass(frozen=True)
class Deadline:
    """An absolute deadline on the monotonic clock (None = the caller set none), with the margin every step
    keeps back for serializing and sending the reply."""

    at: float | None
    clock: Clock = time.monotonic
    margin_s: float = 0.0

    @classmethod
    def after(cls, seconds: float, *, margin_s: float = 0.0, clock: Clock = time.monotonic) -> "Deadline":
        """A deadline ``seconds`` from now (a call the proxy starts on its own, e.g. a related read)."""
        return cls(clock() + seconds, clock, margin_s)

    def remaining(self) -> float | None:
        """Seconds left of the caller's deadline itself (the margin not taken off), None without one."""
        if self.at is None:
            return None
        left = self.at - self.clock()
        return left if left > 0.0 else 0.0  # (a call's every step asks: no max(), no second call)

    def remaining_ms(self) -> int | None:
        """Whole milliseconds left (``timing.deadline_ms`` of an envelope), None without a deadline."""
        remaining = self.remaining()
        return None if remaining is None else int(remaining * 1000)

    def budget(self, cap_s: float = math.inf) -> float:
        """Seconds a step may take: its own ``cap_s`` (a tool's timeout), at most what is left minus the margin.
        <= 0 means no budget is left (it says how late it is); without a deadline, ``cap_s``."""
        return cap_s if self.at is None else self._budget_at(self.clock(), cap_s)

    def _budget_at(self, now: float, cap_s: float) -> float:
        """``budget`` as of ``now`` (a deadline is set): one clock reading serves a step's start and budget."""
        left = self.at - now  # type: ignore[operator]
        left = (left if left > 0.0 else 0.0) - self.margin_s  # (every step asks: no max() or min() calls)
        return cap_s if cap_s <= left else left

    def or_after(self, otherwise_s: float) -> "Deadline":
        """The absolute deadline of a wait: this one less the margin, or ``otherwise_s`` from now when the caller
        set none (a stage's own bound on a wait, e.g. ``locks.max_wait_ms``)."""
        now = self.clock()
        return Deadline(now + (otherwise_s if self.at is None else self.budget()), self.clock)

    def timeout(self) -> asyncio.Timeout:
        """The wire's timeout: an ``async with`` block that ends in ``TimeoutError`` when the budget runs out
        (no deadline: unbounded; the caller of a step without one caps it first, with ``within``)."""
        return asyncio.timeout(None if self.at is None else self.budget())

    @property
    def expired(self) -> bool:
        """No budget is left: a step that has not started must not start."""
        return self.budget() <= 0

    def within(self, cap_s: float) -> "Deadline":
        """The absolute deadline of one step capped at ``cap_s`` (the adapter's call within a tool's timeout):
        the margin is already taken off, so the step's own remaining time is its budget to the wire."""
        now = self.clock()  # one reading: the budget as of the moment the step's deadline starts from
        return Deadline(now + (cap_s if self.at is None else self._budget_at(now, cap_s)), self.clock)

    def defaulted(self, seconds: float) -> "Deadline":
        """This deadline, or one ``seconds`` from now when the caller set none (a batch's default timeout)."""
        if self.at is not None:
            return self
        return Deadline(self.clock() + seconds, self.clock, self.margin_s)


NO_DEADLINE = Deadline(None)  # a decision or step asked outside any caller's call: only its own bound applies


def from_headers(headers: Mapping[str, str], *, max_timeout_s: float, margin_s: float = 0.0,
                 clock: Clock = time.monotonic, wall: Clock = time.time) -> Deadline:
    """Build the caller's deadline; the earlier of the two headers wins. ``margin_s`` is kept back by every step."""
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
        return Deadline(None, clock, margin_s)
    at = min(min(candidates), now_mono + max_timeout_s)
    return Deadline(at, clock, margin_s)


def _number(raw: str, header: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ProxyError("invalid_request", f"{header} must be a number",
                         details={"header": header}, phase="request")
    return value
