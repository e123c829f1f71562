"""The ``mcp`` SDK's private names ``proxy/wire/mcp.py`` reads (``PRIVATE_SDK_NAMES``) still exist and mean what
the module assumes, and the SDK is pinned exactly: this test fails on an SDK upgrade that moves one of them,
before a stateless MCP call does."""

from __future__ import annotations

import inspect
import re
from importlib.metadata import version

import anyio
import mcp_types as types
import pytest
from mcp.client.session import ClientSession
from mcp_types.version import KNOWN_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS

from proxy.wire import mcp as mcp_wire
from tests.unit import REPO

pytestmark = pytest.mark.unit


def new_session() -> ClientSession:
    """A session over in-memory streams (never entered: nothing is sent)."""
    send, receive = anyio.create_memory_object_stream(1)
    return ClientSession(receive, send)


def test_the_sdk_is_pinned_exactly_to_the_installed_version():
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    pins = re.findall(r'"mcp==([^"]+)"', pyproject)
    assert pins == [version("mcp")], "mcp must be pinned exactly (proxy/wire/mcp.py reads private names)"


def test_the_private_names_are_the_ones_listed():
    source = inspect.getsource(mcp_wire)
    used = set(re.findall(r"session\.(_[a-z_]+)", source))
    assert {f"ClientSession.{name}" for name in used} == set(mcp_wire.PRIVATE_SDK_NAMES)


def test_the_stamp_is_what_send_request_stamps_a_request_with():
    session = new_session()
    assert callable(session._stamp)
    data, opts = {"method": "tools/call", "params": {"name": "t", "arguments": {}}}, {}
    session._stamp(data, opts)  # the pre-handshake stamp: takes (data, opts), fills them in place
    assert "self._stamp(data, opts)" in inspect.getsource(ClientSession.send_request)


def test_the_output_schema_cache_is_what_validate_tool_result_checks_against():
    session = new_session()
    assert session._tool_output_schemas == {}
    source = inspect.getsource(ClientSession.validate_tool_result)
    assert "self._tool_output_schemas" in source and "_output_schema_validator" in source
    assert "self._tool_output_schemas[tool.name] = tool.output_schema" in \
        inspect.getsource(ClientSession._absorb_tool_listing)


def test_the_result_adapter_is_the_sdks_for_a_client_without_claims():
    raw = {"content": [{"type": "text", "text": "x"}], "isError": False}
    ours = mcp_wire._CALL_TOOL_RESULT.validate_python(raw, by_name=False)
    theirs = new_session()._call_tool_adapter.validate_python(raw, by_name=False)
    assert type(ours) is type(theirs) is types.CallToolResult and ours == theirs


def test_the_newest_revision_is_stateless_so_the_wire_path_stays_in_use():
    assert KNOWN_PROTOCOL_VERSIONS[-1] in MODERN_PROTOCOL_VERSIONS
