"""``OnFirstUse`` and the deferred adapter (``proxy/lazy.py``, ``proxy/adapters``): built once, on first use,
a failed build raised and tried again, never built only to be closed. That a process without the
configuration never imports the module is checked in a fresh interpreter by tests/test_lazy_imports.py."""

from __future__ import annotations

import threading

import pytest

from proxy.adapters import DeferredAdapter
from proxy.lazy import OnFirstUse


def test_a_deferred_object_is_built_once_on_first_use():
    builds = []
    lazy = OnFirstUse(lambda: builds.append(1) or "built")
    assert lazy.built is None and builds == []
    assert lazy.get() == "built" and lazy.get() == "built" and lazy.warm() == "built"
    assert builds == [1] and lazy.built == "built"


def test_a_failed_build_raises_on_use_and_is_tried_again():
    attempts = []

    def build() -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise ImportError("not yet")
        return "ok"

    lazy = OnFirstUse(build)
    with pytest.raises(ImportError):
        lazy.get()
    assert lazy.built is None
    assert lazy.get() == "ok" and len(attempts) == 2


def test_threads_racing_a_first_use_build_once():
    builds = []
    gate = threading.Barrier(8)
    lazy = OnFirstUse(lambda: builds.append(1) or object())

    def use() -> None:
        gate.wait(timeout=10)
        lazy.get()

    threads = [threading.Thread(target=use) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert builds == [1]


async def test_a_deferred_adapter_is_not_built_to_be_closed_or_asked_how_it_cancels():
    builds = []
    adapter = DeferredAdapter(lambda: builds.append(1) or object(), cancel_by_closing=True)
    assert adapter.cancel_by_closing is True
    await adapter.aclose()
    assert builds == [] and adapter.built is None
