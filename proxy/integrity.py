"""Record integrity: MACs that a process able to write Redis, but without the MAC key, cannot forge.

Owns: the record MAC key (read once from ``integrity.mac_key_file``, or an ephemeral one), the canonical
binding of each record kind it protects, computing a MAC (HMAC-SHA256 over an RFC 8785 array, so no field
can bleed into another) and checking one (constant time), the keys derived from it for other purposes
(the keyed hash of a masked field, sealing a pending approval's approver-readable fields with AES-GCM),
and the ``record_integrity_failed`` error.

Protected records and their bindings (docs/scale.md, "Records a Redis writer cannot forge"):

* an approval (``approval``): id, tenant, subject, tool, version, ``args_hash``, expiry, risk, requester
  (the person claim), status (pending, approved, denied), approver, and the digest of everything else an
  approver is shown or that runs for them (summary, related read, reasons, agent, origin, decision);
* a spent-approval mark (``approval-used``): the same binding plus when and for which operation key it
  was spent;
* a settled operation outcome (``outcome``): operation key, fingerprint (subject, version, ``args_hash``),
  state and the SHA-256 of the stored outcome;
* an operation's meta (``meta``): operation key, fingerprint, tenant and the SHA-256 of the stored meta
  (tool, version, target, compensation inputs), written when the record is created and checked with the
  outcome's.

A record without a MAC (written by a version before this one) or with a MAC that does not verify is never
honoured: the caller raises ``integrity_error``. Must never: put the key in a log, an error, a record or
a Redis command; compare MACs with ``==``; decide what a record means (its owner does).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import rfc8785
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .errors import ProxyError

if TYPE_CHECKING:  # pragma: no cover
    from .audit import Auditor
    from .telemetry.metrics import Metrics

log = logging.getLogger("toolproxy.integrity")

VERSION = "m1"            # the prefix of every stored MAC: a future key or binding change gets a new one
COMPACT = "m2"            # the same MAC in base64url (43 characters, not 64): what every operation record carries
SEALED = "s1"             # the prefix of a sealed (encrypted and authenticated) text: RecordMac.seal
MIN_KEY_BYTES = 32


class IntegrityKeyError(ValueError):
    """The MAC key file cannot be used (one line, names the file)."""


class RecordMac:
    """HMAC-SHA256 over the binding of records a Redis writer must not forge."""

    def __init__(self, key: bytes, *, ephemeral: bool = False) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise IntegrityKeyError(f"the record MAC key must be at least {MIN_KEY_BYTES} bytes")
        self._key = key
        self.ephemeral = ephemeral

    @classmethod
    def from_file(cls, path: str) -> "RecordMac":
        """The key in ``path`` (its bytes, surrounding whitespace stripped; generate one with
        ``openssl rand -hex 32``). Empty ``path``: an ephemeral key only this process knows."""
        if not path:
            return cls(secrets.token_bytes(32), ephemeral=True)
        try:
            key = Path(path).read_bytes().strip()
        except OSError as exc:
            raise IntegrityKeyError(f"integrity.mac_key_file: cannot read {path}: {exc.strerror}") from None
        if len(key) < MIN_KEY_BYTES:
            raise IntegrityKeyError(f"integrity.mac_key_file: {path} holds {len(key)} bytes; at least "
                                    f"{MIN_KEY_BYTES} are needed (openssl rand -hex 32)")
        return cls(key)

    def _mac(self, kind: str, parts: list[Any], version: str = VERSION) -> str:
        message = rfc8785.dumps(["toolproxy.mac/1", kind, *[str(p) for p in parts]])
        tag = hmac.new(self._key, message, hashlib.sha256).digest()
        if version == COMPACT:
            return COMPACT + ":" + base64.urlsafe_b64encode(tag).rstrip(b"=").decode()
        return VERSION + ":" + tag.hex()

    def approval(self, *, approval_id: str, tenant: str, subject: str, tool: str, tool_version: str,
                 args_hash: str, expires_at_ms: int | str, risk: str, status: str, approver: str = "",
                 requester: str = "", shown: str = "") -> str:
        """The MAC of an approval in ``status`` (pending, approved, denied), decided by ``approver``; the
        ``requester`` is the person the self-approval check compares; ``shown`` the digest of everything else
        an approver is shown or that runs for them (``approvals.shown_digest``: the summary with its related
        read, the reasons, the agent, the origin, the decision's time and reason). Kind ``approval/2``: an
        approval MAC'd before ``shown`` was bound does not verify."""
        return self._mac("approval/2", [approval_id, tenant, subject, tool, tool_version, args_hash,
                                        expires_at_ms, risk, requester, status, approver, shown])

    def approval_used(self, *, approval_id: str, tenant: str, subject: str, tool: str, tool_version: str,
                      args_hash: str, expires_at_ms: int | str, used_at_ms: int | str, used_for: str) -> str:
        """The MAC of a spent-approval mark: spent at ``used_at_ms`` on operation ``used_for``."""
        return self._mac("approval-used", [approval_id, tenant, subject, tool, tool_version, args_hash,
                                           expires_at_ms, used_at_ms, used_for])

    def outcome(self, *, key: str, fingerprint: str, state: str, outcome: str, version: str = COMPACT) -> str:
        """The MAC of an operation record settled in ``state`` with ``outcome`` (its JSON text, whether the
        record stores it packed or not: ``record_text``)."""
        digest = hashlib.sha256(outcome.encode()).hexdigest()
        return self._mac("outcome", [key, fingerprint, state, digest], version)

    def meta(self, *, key: str, fingerprint: str, tenant: str, meta: str) -> str:
        """The MAC of an operation record's meta (its JSON text, packed or not) and tenant, written once with
        them when the record is created: what names the operation's tool and contract, its target and its
        compensation's inputs."""
        return self._mac("meta", [key, fingerprint, tenant, hashlib.sha256(meta.encode()).hexdigest()], COMPACT)

    def outcome_matches(self, stored: str | None, *, key: str, fingerprint: str, state: str, outcome: str) -> bool:
        """Whether ``stored`` is this outcome's MAC, in the form it was written (``m2``; ``m1`` by a version
        before it)."""
        version = (stored or "").partition(":")[0]
        if version not in (VERSION, COMPACT):
            return False
        return self.same(self.outcome(key=key, fingerprint=fingerprint, state=state, outcome=outcome,
                                      version=version), stored)

    def derived_key(self, purpose: str) -> bytes:
        """A key for one other purpose, derived from the MAC key (HMAC of the purpose's name), never the MAC
        key itself: ``field-hash`` (the keyed hash of a masked field), ``seal`` (approver-readable fields),
        ``record-fingerprint`` (argument values audit and decision records do not show)."""
        return hmac.new(self._key, b"toolproxy.derived/1\n" + purpose.encode(), hashlib.sha256).digest()

    def seal(self, kind: str, record_id: str, text: str) -> str:
        """``text`` encrypted and authenticated (AES-256-GCM under ``derived_key("seal")``, a random nonce,
        the record's kind and id as associated data, so a sealed text moved to another record does not open):
        ``s1:`` and base64url of nonce and ciphertext."""
        nonce = secrets.token_bytes(12)
        sealed = AESGCM(self.derived_key("seal")).encrypt(nonce, text.encode(), f"{kind}\n{record_id}".encode())
        return SEALED + ":" + base64.urlsafe_b64encode(nonce + sealed).decode()

    def unseal(self, kind: str, record_id: str, stored: str) -> str | None:
        """The text ``seal`` sealed for this record, or None (not sealed, altered, another record's, another
        key's)."""
        version, _, body = stored.partition(":")
        if version != SEALED:
            return None
        try:
            raw = base64.urlsafe_b64decode(body.encode())
            return AESGCM(self.derived_key("seal")).decrypt(raw[:12], raw[12:],
                                                            f"{kind}\n{record_id}".encode()).decode()
        except (ValueError, InvalidTag):
            return None

    @staticmethod
    def same(expected: str, stored: str | None) -> bool:
        """Constant-time comparison; a missing MAC never matches."""
        return bool(stored) and hmac.compare_digest(expected.encode(), (stored or "").encode())


def integrity_error(kind: str, record_id: str, *, phase: str, committed: bool | None = False) -> ProxyError:
    """The one answer to a record whose MAC does not verify: it is not honoured, whatever it says."""
    return ProxyError("record_integrity_failed",
                      "A stored record failed its integrity check and was not used; an operator must look at it.",
                      details={"record": kind, "id": record_id}, phase=phase, attempted=False, committed=committed)


class IntegrityGuard:
    """What a refused record costs: one count, one ``integrity_failure`` audit record, one error."""

    def __init__(self, mac: RecordMac, metrics: "Metrics", audit: "Auditor") -> None:
        self.mac = mac
        self._metrics = metrics
        self._audit = audit

    async def refused(self, record: str, record_id: str, *, phase: str, committed: bool | None = False,
                      **audit_fields: Any) -> ProxyError:
        """Count and audit a record whose MAC did not verify; returns the error to raise."""
        self._metrics.integrity_failures.labels(record).inc()
        log.warning("record %s %s failed its integrity check and was not honoured", record, record_id)
        await self._audit.record("integrity_failure", **audit_fields,
                                 details={"record": record, "id": record_id, "phase": phase})
        return integrity_error(record, record_id, phase=phase, committed=committed)
