"""``toolproxy resolve KEY``: an operator settles an open operation (and so lifts its freeze) in one command.

Owns: turning the command's arguments into the admin API's resolution request
(``POST /v1/operations/{key}/resolve``, ``schemas/operation-resolution.schema.json``)
and its answer into one line. The admin listener does the rest exactly as for the
console: it authenticates the operator, audits the resolution first, records it and
thaws what the operation froze. Must never: touch Redis or the operation record
itself, or take the token from the command line (it would sit in the shell history
and the process list): it is read from the environment.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any
from urllib.parse import quote

import aiohttp

TOKEN_ENV = "TOOLPROXY_ADMIN_TOKEN"
OUTCOMES = ("committed", "not_applied", "rejected")
MAX_ANSWER_BYTES = 64 * 1024


async def _post(url: str, token: str, body: dict[str, Any], timeout_s: float) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {token}"}) as response:
            raw = await response.content.read(MAX_ANSWER_BYTES + 1)
            if len(raw) > MAX_ANSWER_BYTES:
                return response.status, None
            try:
                return response.status, json.loads(raw)
            except ValueError:
                return response.status, None


def resolve(admin_url: str, key: str, outcome: str, evidence: str, result: str | None,
            timeout_s: float = 15.0) -> int:
    """Send the resolution; print the settled state (exit 0) or the refusal's code and message (exit 1)."""
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        print(f"toolproxy resolve: set {TOKEN_ENV} to an operator's admin token", file=sys.stderr)
        return 1
    body: dict[str, Any] = {"outcome": outcome, "evidence": evidence}
    if result is not None:
        try:
            body["result"] = json.loads(result)
        except ValueError:
            print("toolproxy resolve: --result is not valid JSON", file=sys.stderr)
            return 1
    url = f"{admin_url.rstrip('/')}/v1/operations/{quote(key, safe='')}/resolve"
    try:
        status, answer = asyncio.run(_post(url, token, body, timeout_s))
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        print(f"toolproxy resolve: cannot reach the admin listener at {admin_url} ({type(exc).__name__})",
              file=sys.stderr)
        return 1
    if status == 200 and isinstance(answer, dict):
        print(f"resolved {answer.get('idempotency_key', key)}: {answer.get('state')}; its freeze is lifted")
        return 0
    error = answer.get("error") if isinstance(answer, dict) else None
    if isinstance(error, dict):
        print(f"toolproxy resolve: refused ({status} {error.get('code')}): {error.get('message')}", file=sys.stderr)
    else:
        print(f"toolproxy resolve: refused (HTTP {status})", file=sys.stderr)
    return 1
