"""Building the process's credentials from the config, once, at start-up.

Owns: turning each ``credentials.<name>`` entry into its credential (secret files read, TLS contexts and client
authentication prepared) and the metric callback each token endpoint answer reports to. Must never: start a
request (a token is fetched by the first call that needs it), or build a credential at call time.
"""

from __future__ import annotations

from typing import Callable, Mapping

import aiohttp

from ..config import CredentialConfig
from . import Credential, Credentials
from .static import static_credential
from .tls import endpoint_context, tls_context


def load_credentials(configs: Mapping[str, CredentialConfig], session: aiohttp.ClientSession | None, *,
                     on_answer: Callable[[str, str, str], None] | None = None) -> Credentials:
    """Every configured credential; a file that cannot be used stops start-up with one line (ConfigError).
    ``on_answer(name, kind, result)`` is told of every token endpoint answer (``issued`` or a failure reason)."""
    entries: dict[str, Credential] = {}
    for name, config in configs.items():
        if config.kind.startswith("mcp_"):
            continue  # an MCP upstream's OAuth client: built by ``mcp_load`` for the MCP adapter
        where = f"credentials.{name}"
        tls = tls_context(config, where)
        if config.kind in ("client_credentials", "token_exchange"):
            from .oauth import oauth_credential  # authlib: imported only where an OAuth credential is configured

            assert session is not None, "an OAuth credential needs the process's session"
            report = (lambda result, n=name, k=config.kind: on_answer(n, k, result)) if on_answer else None
            entries[name] = oauth_credential(name, config, where, session,
                                             endpoint_context(config.token_ca_file, where), tls, report)
        else:
            entries[name] = static_credential(name, config, where, tls)
    return Credentials(entries)
