"""Interrupting a call's own task from a callback, and taking the interrupt back.

Owns: ``TaskInterrupt``, the one mechanism by which the lock lease (a lost
lease) and the cancellation guard (a cancel request) stop work that runs in
the caller's task instead of a task of its own: ``interrupt`` cancels that
task once, ``take_back`` withdraws the cancel (``Task.uncancel``) and says
whether it was the only one. Must never: swallow a cancel it did not make
(a cancel of the caller itself stays a cancel).
"""

from __future__ import annotations

import asyncio


class TaskInterrupt:
    """One interrupt of the task that created it (at most one pending at a time)."""

    __slots__ = ("_task", "_pending")

    def __init__(self) -> None:
        self._task = asyncio.current_task()
        self._pending = False  # this interrupt cancelled the task and has not taken it back

    @property
    def pending(self) -> bool:
        return self._pending

    def interrupt(self) -> None:
        if not self._pending and self._task is not None:
            self._pending = True
            self._task.cancel()

    def take_back(self) -> bool:
        """Withdraw this interrupt's cancel; True if no other cancel of the task is pending (so a
        ``CancelledError`` the task saw was this interrupt's alone). False when nothing was interrupted."""
        if not self._pending:
            return False
        self._pending = False
        return self._task.uncancel() == 0  # type: ignore[union-attr]
