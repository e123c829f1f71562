"""Secret files: reading a credential's secret, key or certificate once, at start-up.

Owns: reading a configured file into a value the rest of the wing can use, and the one-line error when it cannot
(the setting and the file's name, never its content). Must never: keep a secret anywhere but the credential that
uses it, or put its bytes into an error message.
"""

from __future__ import annotations

from pathlib import Path

from ..config import ConfigError

MAX_SECRET_BYTES = 64 * 1024


def read_secret(path: str, where: str) -> str:
    """A one-line secret (trailing newline and spaces removed); refused when empty, too large or when it holds a
    character a header value cannot carry."""
    data = read_bytes(path, where)
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: {path} is not UTF-8 text") from None
    if not text:
        raise ConfigError(f"{where}: {path} is empty")
    if any(c in text for c in "\r\n\x00"):
        raise ConfigError(f"{where}: {path} holds more than one line (a secret is one line)")
    return text


def read_bytes(path: str, where: str) -> bytes:
    try:
        file = Path(path)
        if file.stat().st_size > MAX_SECRET_BYTES:
            raise ConfigError(f"{where}: {path} is larger than {MAX_SECRET_BYTES} bytes")
        return file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc.strerror or type(exc).__name__}") from None
