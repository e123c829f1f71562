"""Interrupting a call's own task and taking the interrupt back (proxy/interrupts.py)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.interrupts import TaskInterrupt


async def test_an_interrupt_cancels_its_task_once_and_taking_it_back_leaves_no_cancel():
    interrupt = TaskInterrupt()
    interrupt.interrupt()
    interrupt.interrupt()  # once: a second call while pending adds no cancel
    assert interrupt.pending
    with pytest.raises(asyncio.CancelledError):
        await asyncio.sleep(1)
    assert interrupt.take_back() is True and not interrupt.pending
    assert asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0)  # the task runs on: nothing else is pending


async def test_taking_back_says_false_when_the_caller_was_cancelled_too():
    async def work(started: asyncio.Event, interrupts: list[TaskInterrupt], results: list[bool]) -> None:
        interrupts.append(TaskInterrupt())
        started.set()
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            results.append(interrupts[0].take_back())
            raise

    started, interrupts, results = asyncio.Event(), [], []
    task = asyncio.create_task(work(started, interrupts, results))
    await asyncio.wait_for(started.wait(), 5)
    interrupts[0].interrupt()
    task.cancel()  # the caller's own cancel: it must stay a cancel
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert results == [False]


async def test_nothing_interrupted_has_nothing_to_take_back():
    interrupt = TaskInterrupt()
    assert not interrupt.pending and interrupt.take_back() is False
    await asyncio.sleep(0)  # and the task was never cancelled
