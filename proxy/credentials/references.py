"""The registry's references to credentials: every ``backend.auth`` names a configured credential that fits.

Owns: refusing a registry (at start-up, and as a whole on a reload) whose tool names a credential the
configuration lacks, names one on a backend kind that cannot carry it (the ``mcp_*`` kinds are for MCP upstreams
only, which take them, a static secret: header, bearer, basic, or token_exchange on behalf of the caller; a
per-user or per-caller one for no pinned tool, a per-user one for the upstream its users connect to, and
a token_exchange one for an upstream reached by URL only with the credential's audience), or pairs a credential's TLS settings with a plain-http backend. Must never: read a secret (only names and settings are compared).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..config import CredentialConfig
from . import STATIC_SECRET_KINDS
from ..registry import Registry, RegistryError


# Each rule: when a tool's reference (the tool, its credential's entry, the backend's URL) cannot work, and the
# error saying why and what to do. The first rule that applies refuses the registry.
_Rule = tuple[Callable[[Any, CredentialConfig, str], bool], str]
_RULES: tuple[_Rule, ...] = (
    (lambda tool, entry, url: tool.backend.type == "http" and entry.kind.startswith("mcp_"),
     "{where}: kind {kind} is for MCP upstreams; an HTTP backend takes the other kinds"),
    (lambda tool, entry, url: tool.backend.type == "mcp" and not entry.kind.startswith("mcp_")
        and entry.kind not in (*STATIC_SECRET_KINDS, "token_exchange"),
     "{where}: kind {kind} cannot ride an MCP upstream; give it a credential of kind mcp_client_credentials, "
     "mcp_authorization_code, token_exchange, header, bearer or basic"),
    # A pin check lists the upstream's tools for no caller: there is no caller's token to exchange.
    (lambda tool, entry, url: tool.backend.type == "mcp" and entry.kind == "token_exchange"
        and tool.backend.pin is not None,
     "{where}: a pinned tool (backend.pin) is checked with no caller, and a token_exchange credential needs one; "
     "remove the pin, or reach the upstream with an mcp_client_credentials credential"),
    # Without a service name the default audience is the tool's own (tool.<name>): two tools of one
    # upstream would exchange each caller's token twice, for audiences the server knows neither of.
    (lambda tool, entry, url: tool.backend.type == "mcp" and entry.kind == "token_exchange" and not entry.audience
        and tool.backend.service is None,
     "{where}: a token_exchange credential for an MCP upstream reached by URL needs the upstream's audience; set "
     "credentials.{name}.audience, or name the upstream in backends.services and give the tool backend.service"),
    # The MCP adapter's connections (and the OAuth client's) use the system's CAs and no client
    # certificate: settings they would silently drop.
    (lambda tool, entry, url: tool.backend.type == "mcp" and bool(entry.tls_cert_file or entry.tls_ca_file),
     "{where}: an MCP upstream is reached without the credential's TLS settings; remove tls_cert_file, "
     "tls_key_file and tls_ca_file from it"),
    (lambda tool, entry, url: entry.kind == "mcp_authorization_code" and url != entry.resource,
     "{where}: the users connect their accounts to {resource!r} (the credential's resource), not to this tool's "
     "upstream; give the tool that URL or name a credential of its own"),
    # A pin check lists the upstream's tools for no user: with only users' grants it could never pass,
    # and every call of the tool would be refused as unverified.
    (lambda tool, entry, url: entry.kind == "mcp_authorization_code" and tool.backend.pin is not None,
     "{where}: a pinned tool (backend.pin) is checked with the proxy's own token, and a per-user credential has "
     "none; remove the pin, or reach the upstream with an mcp_client_credentials credential"),
    (lambda tool, entry, url: bool(entry.tls_cert_file or entry.tls_ca_file) and url.startswith("http://"),
     "{where} carries TLS settings but the backend's URL is plain http; use an https URL (backends.services, "
     "or the tool's backend.url)"),
)


def check_references(registry: Registry, credentials: Mapping[str, CredentialConfig],
                     services: Mapping[str, str]) -> None:
    """RegistryError naming the tool, the credential and the fix, for the first reference that cannot work."""
    for tool in registry.all():
        name = tool.backend.auth
        if name is None:
            continue
        where = f"{tool.source}: tool {tool.name!r} version {tool.version}: backend.auth {name!r}"
        entry = credentials.get(name)
        if entry is None:
            known = ", ".join(sorted(credentials)) or "none"
            raise RegistryError(f"{where} is not a configured credential (configured: {known}); add "
                                f"credentials.{name} to the proxy's configuration or fix the name")
        url = tool.backend.resolve(services) or ""
        for applies, message in _RULES:
            if applies(tool, entry, url):
                raise RegistryError(message.format(where=where, kind=entry.kind, name=name, resource=entry.resource))
