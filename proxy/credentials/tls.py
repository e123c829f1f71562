"""TLS contexts of credentials: a client certificate and a CA bundle per backend service (mutual TLS).

Owns: building one ``ssl.SSLContext`` per credential that names a certificate or a CA (certificate and hostname
checked, as the system default does), and the one-line error when its files cannot be used. Must never: turn off
verification, or read a file at call time.
"""

from __future__ import annotations

import ssl

from ..config import ConfigError, CredentialConfig


def tls_context(config: CredentialConfig, where: str) -> ssl.SSLContext | None:
    """The context a credential's backend is reached with; None when it names neither certificate nor CA."""
    if not (config.tls_cert_file or config.tls_ca_file):
        return None
    try:
        context = ssl.create_default_context(cafile=config.tls_ca_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{where}.tls_ca_file: cannot use {config.tls_ca_file}: "
                          f"{getattr(exc, 'strerror', None) or type(exc).__name__}") from None
    if config.tls_cert_file:
        try:
            context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
        except (OSError, ssl.SSLError) as exc:
            why = getattr(exc, "strerror", None) or type(exc).__name__
            raise ConfigError(f"{where}.tls_cert_file: cannot use {config.tls_cert_file} with "
                              f"{config.tls_key_file}: {why}") from None
    return context


def endpoint_context(ca_file: str, where: str) -> ssl.SSLContext | bool:
    """How a token endpoint is verified: its own CA bundle, else the system's (``True`` for aiohttp)."""
    if not ca_file:
        return True
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{where}.token_ca_file: cannot use {ca_file}: "
                          f"{getattr(exc, 'strerror', None) or type(exc).__name__}") from None
