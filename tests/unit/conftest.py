"""Fast unit tests: pure modules of ``proxy/``, no OPA, no Redis, no processes.

Every test collected below this directory is marked ``unit`` (``pytest -m unit``
selects them from the whole suite; ``scripts/test.sh --fast`` runs only them,
without loading ``tests/conftest.py`` and its server fixtures). A test that
needs a real server belongs one directory up.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.unit)


def pytest_collection_finish(session):
    # What collection built (the modules, the parsed package, the test items) lives to the end of the run: moved
    # out of the collector's sight, so that the collections the tests cause, and the last one at exit, do not
    # walk it again each time (about 1.5 s of the tier's 14 went to that).
    gc.freeze()
