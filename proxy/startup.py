"""The sidecar's start-up and the cyclic garbage collector (start to ``/readyz``).

Owns: how the collector runs while ``toolproxy run`` starts. A start builds about 70,000 objects that live
as long as the process (modules, classes, functions, the registry, the runtime), and CPython's collector
walked them again and again while they were being built: with its default thresholds about 160 collections
during the imports alone, 120 ms of a 1.0 s import on a 2-core VM, most of it in the older
generations' collections (each walks everything that survived so far). So from the first line of the
entry (``python -m proxy.cli``) until the listeners are up, only the youngest generation is collected
(``begin``: the short-lived cycles of parsing and building die there as before), and then (``end``)
everything alive is moved to the permanent generation (``gc.freeze()``) and the thresholds the process had
are restored: collections after start-up walk only what was made after it, so serving does not pay for the
start-up's objects either.

What that costs: cyclic garbage that outlived a young collection during start-up is frozen with the rest and
never freed (about 2,400 objects, 0.3 MB resident in a JSON-only process), and so is a start-up object that
becomes cyclic garbage later (the first registry after a reload, if it holds cycles: once). Objects freed by
their reference count are freed as ever. ``docs/performance.md#footprint`` has the measurements.

Must never: change the collector for a process that did not ``begin`` (importing ``proxy.cli`` from another
program changes nothing), disable the collector (the youngest generation always runs), or keep start-up's
thresholds after ``end``. Used by ``proxy/cli.py`` (and ``bench/import_shares.py``, to measure imports as
the entry makes them).
"""

from __future__ import annotations

import gc

# Older generations' thresholds while starting: never reached by the objects one start builds.
_NOT_WHILE_STARTING = 1_000_000_000

_restore: tuple[int, ...] | None = None  # the thresholds to put back; None: not starting


def begin() -> None:
    """From now until ``end``: collect the youngest generation only (a second call changes nothing)."""
    global _restore
    if _restore is not None:
        return
    _restore = gc.get_threshold()
    gc.set_threshold(_restore[0], _NOT_WHILE_STARTING, _NOT_WHILE_STARTING)


def end(*, freeze: bool) -> None:
    """Start-up is over: with ``freeze``, everything alive now goes to the permanent generation (``gc.freeze``);
    the thresholds from before ``begin`` are restored. Nothing to do when ``begin`` was not called."""
    global _restore
    if _restore is None:
        return
    if freeze:
        gc.freeze()
    gc.set_threshold(*_restore)
    _restore = None


def starting() -> bool:
    """Whether ``begin`` was called and ``end`` not yet."""
    return _restore is not None
