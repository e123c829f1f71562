"""Wires: the hand-written hot-path clients (HTTP/1.1 on llhttp, RESP, an MCP ``tools/call``), the
counted connection they share and the compiled schema check. Owns: bytes on the wire, bounded.
Must never: know a stage, a tool contract or a policy.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def json_bytes(body: Any) -> bytes:
    """Compact UTF-8 JSON (orjson; the standard encoder for what orjson refuses, such as an integer beyond
    64 bits in a backend's output)."""
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
