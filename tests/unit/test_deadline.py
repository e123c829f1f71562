"""Deadlines without servers: what is left, in the units the envelope and the stages use (proxy/deadline.py),
and the rule that keeps the call's time limit one value: built once at ingress with its margin, asked by every
step, carried to the adapters as a ``Deadline`` (checked on the package's source, nothing imported)."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

from proxy.adapters import BackendCall
from proxy.deadline import Deadline, from_headers
from tests.unit import REPO, parsed, walk

PACKAGE = REPO / "proxy"


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_remaining_ms_is_whole_milliseconds_left_and_none_without_a_deadline():
    clock = Clock(100.0)
    deadline = Deadline(101.2345, clock)
    assert deadline.remaining_ms() == 1234  # truncated, as timing.deadline_ms always was
    clock.now = 101.0
    assert deadline.remaining_ms() == 234
    assert Deadline(None, clock).remaining_ms() is None


def test_remaining_ms_never_goes_below_zero_once_the_deadline_passed():
    clock = Clock(10.0)
    deadline = Deadline(9.0, clock, margin_s=0.1)
    assert deadline.remaining_ms() == 0 and deadline.remaining() == 0.0
    assert deadline.budget(5.0) < 0  # the budget, unlike what is left, says how late it is
    assert deadline.expired


def test_budget_is_the_steps_cap_limited_by_what_is_left_minus_the_deadlines_own_margin():
    clock = Clock(0.0)
    assert Deadline(None, clock, 0.1).budget(5.0) == 5.0
    assert Deadline(2.0, clock, 0.5).budget(5.0) == 1.5
    assert Deadline(20.0, clock, 0.5).budget(5.0) == 5.0
    assert Deadline(2.0, clock, 0.5).budget() == 1.5  # no cap of its own: what is left minus the margin
    assert Deadline(None, clock).budget() == float("inf") and not Deadline(None, clock).expired


def test_the_margin_is_set_once_at_ingress_and_kept_by_every_step():
    clock = Clock(50.0)
    deadline = from_headers({"Request-Timeout": "2"}, max_timeout_s=600, margin_s=0.05, clock=clock)
    assert deadline.margin_s == 0.05 and deadline.budget(10.0) == pytest.approx(1.95)
    assert from_headers({}, max_timeout_s=600, margin_s=0.05, clock=clock) == Deadline(None, clock, 0.05)
    assert Deadline.after(3.0, margin_s=0.05, clock=clock) == Deadline(53.0, clock, 0.05)


def test_a_steps_deadline_is_absolute_with_the_margin_taken_off_and_ends_where_its_budget_does():
    clock = Clock(0.0)
    caller = Deadline(2.0, clock, margin_s=0.5)
    step = caller.within(5.0)  # the caller's deadline is the nearer one
    assert step.at == pytest.approx(1.5) and step.margin_s == 0.0
    clock.now = 1.0
    assert step.budget() == pytest.approx(0.5) == caller.budget(5.0)  # the same answer, asked later
    assert Deadline(None, clock, 0.5).within(5.0).at == pytest.approx(6.0)  # no deadline: the step's cap


def test_or_after_bounds_a_wait_by_the_stages_own_bound_only_without_a_deadline():
    clock = Clock(1.0)
    assert Deadline(None, clock, 0.05).or_after(3.0) == Deadline(4.0, clock)
    wait = Deadline(10.0, clock, 0.05).or_after(3.0)  # the deadline less the margin, not the bound
    assert wait.at == pytest.approx(9.95) and wait.margin_s == 0.0
    clock.now = 9.95
    assert wait.expired


def test_defaulted_gives_a_call_without_a_deadline_one_and_keeps_the_margin():
    clock = Clock(5.0)
    assert Deadline(None, clock, 0.05).defaulted(30.0) == Deadline(35.0, clock, 0.05)
    set_by_caller = Deadline(7.0, clock, 0.05)
    assert set_by_caller.defaulted(30.0) is set_by_caller


async def test_the_wire_timeout_ends_the_block_when_the_budget_runs_out():
    with pytest.raises(TimeoutError):
        async with Deadline.after(0.01, margin_s=0.0).timeout():
            await asyncio.Event().wait()  # never set: only the deadline ends the wait
    async with Deadline(None).timeout():  # no deadline: the block is not bounded here
        await asyncio.sleep(0)


# --- the rule, read from the source ---------------------------------------------------------------------

# Where the one margin setting is read: the config (it is defined there) and the fronts that build the call's
# Deadline at ingress. Everywhere else a step asks its Deadline.
MARGIN_READERS = {"proxy/config.py", "proxy/deadline.py"}
MARGIN_BUILDERS = "proxy/fronts/"


def _identifiers(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in walk(tree):
        if isinstance(node, ast.Name):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.arg):
            found.append((node.lineno, node.arg))
        elif isinstance(node, ast.keyword) and node.arg:
            found.append((node.value.lineno, node.arg))
    return found


def margins_held(tree: ast.AST) -> list[str]:
    """Names that hold a deadline margin (``_margin_s``, ``margin_s=...``) in a module."""
    return [f"{line}: {name}" for line, name in _identifiers(tree) if "margin" in name.lower()]


def _is_call_to(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name


def _mentions(node: ast.AST, words: tuple[str, ...]) -> bool:
    return any(any(w in name.lower() for w in words) for _, name in _identifiers(node))


def deadline_math(tree: ast.AST) -> list[str]:
    """Deadline arithmetic done by hand: reading a deadline's ``.at``, adding to or subtracting from what a
    ``Deadline.remaining()`` answered, or from the monotonic clock beside a deadline or a budget."""
    found: list[str] = []
    for node in walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "at" and _mentions(node.value, ("deadline",)):
            found.append(f"{node.lineno}: .at of a deadline")
        if not isinstance(node, ast.BinOp) or not isinstance(node.op, (ast.Add, ast.Sub)):
            continue
        sides = (node.left, node.right)
        if any(_is_call_to(s, "remaining") for s in sides):
            found.append(f"{node.lineno}: arithmetic on remaining()")
        if any(_is_call_to(s, name) for s in sides for name in ("budget", "or_after", "within")):
            found.append(f"{node.lineno}: a budget turned into a time by hand")
        clock = [s for s in sides if any(_is_call_to(n, "monotonic") for n in walk(s))]
        other = [s for s in sides if not any(_is_call_to(n, "monotonic") for n in walk(s))]
        if clock and other and _mentions(node, ("deadline", "budget", "remaining")):
            found.append(f"{node.lineno}: the monotonic clock against a deadline or budget")
    return found


def _modules() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(REPO)), parsed(p)) for p in sorted(PACKAGE.rglob("*.py"))]


def test_the_checks_see_a_margin_held_and_deadline_math_done_by_hand():
    source = ("class Stage:\n    def __init__(self, config):\n        self._margin_s = config.margin_ms / 1000\n"
              "    def budget(self, meta, started):\n"
              "        left = meta.deadline.remaining() - self._margin_s\n"
              "        until = meta.deadline.at\n"
              "        return budget_s - (time.monotonic() - started)\n"
              "    def wait(self, deadline, started):\n"
              "        return started + deadline.budget(5.0)\n")
    tree = ast.parse(source)
    assert margins_held(tree) == ["3: _margin_s", "3: margin_ms", "5: _margin_s"]
    assert deadline_math(tree) == ["5: arithmetic on remaining()", "6: .at of a deadline",
                                   "7: the monotonic clock against a deadline or budget",
                                   "9: a budget turned into a time by hand"]
    clean = ast.parse("budget = meta.deadline.budget(tool.timeout_ms / 1000.0)\nelapsed = time.monotonic() - t0\n")
    assert margins_held(clean) == [] and deadline_math(clean) == []


def test_no_module_but_the_ingress_and_the_config_names_a_deadline_margin():
    held = {name: margins_held(tree) for name, tree in _modules()
            if name not in MARGIN_READERS and not name.startswith(MARGIN_BUILDERS)}
    assert {name: found for name, found in held.items() if found} == {}


def test_no_module_but_proxy_deadline_does_deadline_arithmetic():
    math = {name: deadline_math(tree) for name, tree in _modules() if name != "proxy/deadline.py"}
    assert {name: found for name, found in math.items() if found} == {}


def test_the_adapters_are_handed_a_deadline_not_seconds():
    hints = typing.get_type_hints(BackendCall)
    assert hints["deadline"] is Deadline
    assert not [f.name for f in dataclasses.fields(BackendCall) if "budget" in f.name or f.name.endswith("_s")]
    # a step asks with its own cap only: the margin is the Deadline's, never an argument
    assert list(inspect.signature(Deadline.budget).parameters) == ["self", "cap_s"]
