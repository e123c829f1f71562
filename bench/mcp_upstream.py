"""A trivial upstream MCP server for the benchmark: one read tool returning structured content.

Built with the ``mcp`` SDK's ``MCPServer`` (Streamable HTTP, JSON responses),
served by uvicorn in its own process so its CPU is not the proxy's. Its ``lookup`` answers what the
tests' upstream does, so the proxy fronts it with the tests' registry entry ``up_lookup``
(``tests.support.mcp_upstream.registry_yaml``).

    python -m bench.mcp_upstream --port P [--stateless]
"""

from __future__ import annotations

import argparse
from typing import TypedDict

import uvicorn
from mcp.server.mcpserver import MCPServer


class Entry(TypedDict):
    key: str
    value: str


def build_server() -> MCPServer:
    server = MCPServer("bench-upstream")

    @server.tool()
    def lookup(key: str) -> Entry:
        return {"key": key, "value": f"value-of-{key}"}

    return server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stateless", action="store_true", help="stateless_http (no sessions)")
    args = parser.parse_args()
    app = build_server().streamable_http_app(json_response=True, stateless_http=args.stateless)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="critical", access_log=False)


if __name__ == "__main__":
    main()
