"""The seam between a front and an adapter is one typed value (proxy/call_channel.py): the ``CallChannel`` a front
puts on its ``ToolCallRequest`` reaches cancellation and, on the ``BackendCall``, the adapter, explicitly. No
context variable at module level joins the layers (read from the package's source, nothing imported): the only
ones left are telemetry's (a log line's or a span's context), which every layer may read."""

from __future__ import annotations

import ast
import dataclasses
import typing

from proxy.adapters import BackendCall
from proxy.call_channel import NO_CHANNEL, CallChannel
from proxy.requests import ToolCallRequest
from tests.unit import REPO, parsed

PACKAGE = REPO / "proxy"
CONTEXT_OWNERS = "proxy/telemetry/"  # the request's log context and its span: read anywhere, set by the fronts


def module_context_variables(tree: ast.Module) -> list[str]:
    """The module-level names bound to a ``ContextVar`` (annotated or not)."""
    found = []
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        called = value.func if isinstance(value, ast.Call) else None
        name = called.attr if isinstance(called, ast.Attribute) else getattr(called, "id", "")
        if name == "ContextVar":
            found += [f"{node.lineno}: {t.id}" for t in targets if isinstance(t, ast.Name)]
    return found


def test_the_check_sees_a_module_level_context_variable():
    tree = ast.parse("import contextvars\nfrom contextvars import ContextVar\n"
                     "relay: contextvars.ContextVar[int | None] = contextvars.ContextVar('r', default=None)\n"
                     "signal = ContextVar('s')\n"
                     "class Adapter:\n    def __init__(self):\n        self._call = contextvars.ContextVar('c')\n")
    assert module_context_variables(tree) == ["3: relay", "4: signal"]  # an adapter's own, per object: not a seam


def test_no_context_variable_joins_a_front_to_the_pipeline_or_an_adapter():
    found = {str(p.relative_to(REPO)): module_context_variables(parsed(p)) for p in sorted(PACKAGE.rglob("*.py"))}
    assert {name: names for name, names in found.items() if names and not name.startswith(CONTEXT_OWNERS)} == {}


def test_the_channel_travels_on_the_request_and_on_the_backend_call():
    for carrier in (ToolCallRequest, BackendCall):
        assert typing.get_type_hints(carrier)["channel"] is CallChannel
        assert {f.name: f.default for f in dataclasses.fields(carrier)}["channel"] is NO_CHANNEL


def test_a_call_without_a_channel_relays_nothing_and_cannot_be_withdrawn():
    assert (NO_CHANNEL.progress, NO_CHANNEL.log, NO_CHANNEL.input, NO_CHANNEL.withdrawn) == (None,) * 4
    assert dataclasses.is_dataclass(CallChannel) and CallChannel.__dataclass_params__.frozen  # type: ignore[attr-defined]
