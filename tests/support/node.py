"""The pinned Node tools (scripts/setup.sh installs them into .tools/node from
tests/node/package-lock.json): a Node 22 binary, the MCP conformance suite, the
TypeScript SDK (used by tests/node/*.mjs), the Inspector CLI (and the older inspector-cli) and
server-everything. Every run is bounded; a missing install fails with the fix."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any, Mapping

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "node"
BIN = REPO / ".tools" / "node" / "node_modules" / ".bin"


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists() or not (SCRIPTS / "node_modules").exists():
        raise RuntimeError(f"{path} missing: run scripts/setup.sh (it installs the pinned Node tools)")
    return str(path)


def node_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """PATH with the pinned Node 22 first (the npm bin shims run `node` from PATH)."""
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "NO_COLOR": "1",
            **(extra or {})}


async def run(*argv: str, timeout_s: float = 60.0, env: Mapping[str, str] | None = None,
              cwd: Path | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE, env=node_env(env),
                                                cwd=str(cwd or REPO))
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode(), err.decode()


async def ts_client(url: str, calls: list[dict[str, Any]], headers: Mapping[str, str] | None = None,
                    timeout_s: float = 60.0) -> dict[str, Any]:
    """Run tests/node/ts_client.mjs (TypeScript SDK Client) against ``url``; its JSON report."""
    plan = json.dumps({"headers": dict(headers or {}), "calls": calls})
    code, out, err = await run(tool("node"), str(SCRIPTS / "ts_client.mjs"), url, plan, timeout_s=timeout_s)
    assert code == 0, f"ts_client failed ({code}): {err[-2000:]}"
    return json.loads(out)
