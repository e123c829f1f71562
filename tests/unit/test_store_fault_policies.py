"""Store faults are answered in one vocabulary: a call site names its policy with the helpers of
proxy/store.py (``unavailable_on_fault``, ``degrade_on_fault``, ``logged_on_fault``, ``fault_as_value``);
the few ``except`` clauses on a store error left outside the store each say which policy they follow on a
``# policy:`` line (on the ``except`` line or the one below). The helpers' own behaviour is checked here too,
without a server."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from proxy import store
from proxy.errors import ProxyError
from tests.unit import REPO, parsed, walk

PACKAGE = REPO / "proxy"
STORE_ERRORS = {"StoreError", "StoreUnavailable", "RedisError"}
MOST_CLAUSES = 8


def is_store_error(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in STORE_ERRORS) or \
        (isinstance(node, ast.Attribute) and node.attr in STORE_ERRORS)


def catches_store_error(handler: ast.ExceptHandler) -> bool:
    caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(is_store_error(t) for t in caught)


def silent_suppressions(tree: ast.Module) -> list[int]:
    """Lines of ``contextlib.suppress(<a store error>, ...)``: a fault dropped without a named policy."""
    return [node.lineno for node in walk(tree) if isinstance(node, ast.Call)
            and (getattr(node.func, "attr", None) == "suppress" or getattr(node.func, "id", None) == "suppress")
            and any(is_store_error(arg) for arg in node.args)]


def store_clauses(tree: ast.Module, lines: list[str]) -> list[tuple[int, bool]]:
    """(line, names its policy) of every ``except`` clause that catches a store error."""
    return [(node.lineno, any("# policy:" in line for line in lines[node.lineno - 1:node.lineno + 1]))
            for node in walk(tree) if isinstance(node, ast.ExceptHandler) and node.type is not None
            and catches_store_error(node)]


def clauses_outside_the_store() -> dict[str, list[tuple[int, bool]]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "store.py":
            continue
        clauses = store_clauses(parsed(path), path.read_text(encoding="utf-8").splitlines())
        if clauses:
            found[str(path.relative_to(REPO))] = clauses
    return found


def test_the_scan_sees_each_way_to_catch_a_store_error():
    source = ("try:\n    pass\nexcept store.StoreError:  # policy: retry\n    pass\n"
              "try:\n    pass\nexcept (OSError, StoreError) as exc:\n    # policy: count\n    pass\n"
              "try:\n    pass\nexcept StoreUnavailable:\n    pass\n"
              "try:\n    pass\nexcept ValueError:  # policy: not a store error\n    pass\n")
    assert store_clauses(ast.parse(source), source.splitlines()) == [(3, True), (7, True), (12, False)]
    assert silent_suppressions(ast.parse("with contextlib.suppress(store.StoreError, OSError):\n    pass\n"
                                         "with suppress(ValueError):\n    pass\n")) == [1]


def test_few_store_fault_clauses_remain_and_each_names_its_policy():
    found = clauses_outside_the_store()
    unnamed = {path: [line for line, named in clauses if not named] for path, clauses in found.items()}
    assert not {path: lines for path, lines in unnamed.items() if lines}, \
        "add a `# policy:` line naming what the clause does with the fault (or use a helper of proxy/store.py)"
    count = sum(len(clauses) for clauses in found.values())
    assert count <= MOST_CLAUSES, f"{count} except clauses on store errors: use the named helpers of proxy/store.py"


def test_no_store_fault_is_dropped_silently():
    found = {str(p.relative_to(REPO)): lines for p in sorted(PACKAGE.rglob("*.py"))
             if p != PACKAGE / "store.py" and (lines := silent_suppressions(parsed(p)))}
    assert not found, f"name the policy (store.logged_on_fault, level=logging.DEBUG for a quiet cleanup): {found}"


# -- the helpers ---------------------------------------------------------------

async def failing() -> str:
    raise store.StoreUnavailable("ConnectionError")


async def answering() -> str:
    return "answer"


def test_fail_closed_answers_dependency_unavailable():
    with pytest.raises(ProxyError) as raised:
        with store.unavailable_on_fault("The lock store is unavailable.", phase="lock", limit="tenant"):
            raise store.StoreUnavailable("ConnectionError")
    assert (raised.value.code, raised.value.phase, raised.value.details) == (
        "dependency_unavailable", "lock", {"dependency": "state_store", "limit": "tenant"})


async def test_degrade_answers_the_fallback_only_for_a_fault():
    assert await store.degrade_on_fault(answering(), lambda _: "fallback") == "answer"
    assert await store.degrade_on_fault(failing(), lambda fault: type(fault).__name__) == "StoreUnavailable"
    with pytest.raises(TimeoutError):  # not a store fault unless the site says so
        await store.degrade_on_fault(_raise(TimeoutError()), lambda _: "fallback")
    assert await store.degrade_on_fault(_raise(TimeoutError()), lambda _: "fallback",
                                        faults=store.STORE_OR_SOCKET_FAULTS) == "fallback"


async def _raise(exc: BaseException) -> str:
    raise exc


async def test_count_and_go_on_logs_the_class_counts_and_ends_the_block(caplog):
    counted, after = [], []
    with caplog.at_level(logging.WARNING, logger="tests.store"):
        with store.logged_on_fault(logging.getLogger("tests.store"), "could not share %s", "x",
                                   count=lambda: counted.append(1)):
            await failing()
            after.append("not reached")
    assert after == [] and counted == [1]
    assert [r.getMessage() for r in caplog.records] == ["could not share x (StoreUnavailable)"]
    with pytest.raises(ValueError):  # the proxy's own fault is not the store's
        with store.logged_on_fault(logging.getLogger("tests.store"), "m"):
            raise ValueError("own bug")


async def test_keep_as_value_returns_the_fault():
    assert await store.fault_as_value(answering()) == "answer"
    fault = await store.fault_as_value(failing())
    assert isinstance(fault, store.StoreUnavailable)


def test_the_helpers_live_beside_the_store_boundary():
    source = (PACKAGE / "store.py").read_text(encoding="utf-8")
    for name in ("unavailable_on_fault", "degrade_on_fault", "logged_on_fault", "fault_as_value"):
        assert f"def {name}(" in source
    assert Path(__file__).name in source  # the store's vocabulary comment points here
