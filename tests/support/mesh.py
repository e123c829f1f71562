"""``identity.mode: headers`` as a mesh would run it: the identity headers plus the hop proof.

The proxy believes header-borne identity only from a request that proves it
came through the trusted hop (docs/authorization.md). Tests that play the mesh
configure the secret with ``mesh_settings`` and send ``mesh_headers``.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

HOP_HEADER = "X-Toolproxy-Hop-Secret"
HOP_SECRET = "mesh-" + secrets.token_hex(16)  # one per test session, like a Secret in a cluster


def mesh_settings(directory: Path, agent_id: str = "agent-under-test") -> dict[str, Any]:
    """Config overrides: headers mode with the hop secret written to a file in ``directory``."""
    path = Path(directory) / "hop-secret"
    path.write_text(HOP_SECRET + "\n")
    return {"identity.mode": "headers", "identity.agent_id": agent_id,
            "identity.headers.proof_secret_file": str(path)}


def mesh_headers(subject: str, tenant: str, roles: str = "agent", scopes: str = "tools:read tools:write",
                 **extra: str) -> dict[str, str]:
    """What the mesh sends: the identity headers and the hop proof."""
    return {"X-Auth-Subject": subject, "X-Auth-Tenant": tenant, "X-Auth-Roles": roles, "X-Auth-Scopes": scopes,
            HOP_HEADER: HOP_SECRET, **extra}
