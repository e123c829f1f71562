"""Quota rules: which limits apply to a call, as data (no Redis, no I/O).

Owns: the shape of one limit (``LimitSpec``: a rate with a burst and/or a
concurrency quota, and what to do when Redis is unreachable), the compact
text form the configuration uses (``rate=10/1s burst=5 concurrency=3
on_redis_error=closed``), the registry's structured form, the backend name of a
tool (the key of its breaker and backend limits), and ``applicable``: the
limits that apply to one call with the Redis key each one counts in.
Must never: talk to Redis, decide what a refusal looks like (``proxy/quotas.py``
does), or take a tenant, subject or class from anywhere but the trusted caller
and the OPA decision.

Where limits come from:

* registry: a tool's ``quotas`` (counted per tool, across tenants) and a
  backend service's ``quotas`` under the file's ``services:`` (counted per
  backend service, across its tools);
* configuration: ``quotas.tenant`` (each tenant its own budget),
  ``quotas.tenants`` (per-tenant overrides of it), ``quotas.subject`` (each
  caller its own budget) and ``quotas.fleet`` (one budget for all calls);
* the OPA decision's ``quota_class``: ``quotas.classes[<class>]`` replaces the
  caller's ``subject`` limit (``per=tenant``: the tenant's).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import quote

_PERIOD = re.compile(r"^(\d+(?:\.\d+)?)?(ms|s|m|h)$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60000, "h": 3600000}
REDIS_POLICIES = ("auto", "open", "closed")
SCOPES = ("tenant", "subject", "tool", "backend", "fleet")


class LimitSpecError(ValueError):
    """A limit's text or registry form is malformed; the message says what."""


@dataclass(frozen=True)
class LimitSpec:
    """``rate`` calls per ``period_ms`` with up to ``burst`` at once, and/or at most ``concurrency`` in flight."""

    rate: int = 0
    period_ms: int = 1000
    burst: int = 0                 # 0: one period's worth (= rate)
    concurrency: int = 0           # 0: no concurrency quota
    on_redis_error: str = "auto"   # auto: closed for write tools, open for reads (the idempotency stage's rule)
    per: str = "subject"           # classes only: whose budget a class replaces (subject or tenant)

    def __post_init__(self) -> None:
        if self.rate < 0 or self.concurrency < 0 or self.burst < 0 or self.period_ms < 1:
            raise LimitSpecError("rate, burst and concurrency must not be negative, the period must be positive")
        if not self.rate and not self.concurrency:
            raise LimitSpecError("a limit needs a rate, a concurrency quota or both")
        if self.on_redis_error not in REDIS_POLICIES:
            raise LimitSpecError(f"on_redis_error: expected auto, open or closed, got {self.on_redis_error!r}")
        if self.per not in ("subject", "tenant"):
            raise LimitSpecError(f"per: expected subject or tenant, got {self.per!r}")

    @property
    def bucket(self) -> int:
        return self.burst or self.rate

    @property
    def emission_ms(self) -> float:
        """GCRA's emission interval: one call's share of the period."""
        return self.period_ms / self.rate

    def fails_closed(self, is_write: bool) -> bool:
        return self.on_redis_error == "closed" or (self.on_redis_error == "auto" and is_write)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"on_redis_error": self.on_redis_error}
        if self.rate:
            out.update(rate=self.rate, period_ms=self.period_ms, burst=self.bucket)
        if self.concurrency:
            out["concurrency"] = self.concurrency
        return out


def parse_spec(text: str) -> LimitSpec:
    """``rate=10/1s burst=5 concurrency=3 on_redis_error=closed per=tenant`` (any subset, space separated)."""
    fields: dict[str, Any] = {}
    for token in text.split():
        name, sep, value = token.partition("=")
        if not sep or not value:
            raise LimitSpecError(f"expected name=value, got {token!r}")
        if name == "rate":
            count, slash, period = value.partition("/")
            fields["rate"] = _positive(count, "rate")
            fields["period_ms"] = _period_ms(period if slash else "1s")
        elif name in ("burst", "concurrency"):
            fields[name] = _positive(value, name)
        elif name in ("on_redis_error", "per"):
            fields[name] = value
        else:
            raise LimitSpecError(f"unknown limit field {name!r} (rate, burst, concurrency, on_redis_error, per)")
    if not fields:
        raise LimitSpecError("empty limit")
    return LimitSpec(**fields)


def spec_from_registry(raw: Mapping[str, Any]) -> LimitSpec:
    """The registry's ``quotas: {rate, per_s, burst, concurrency, on_redis_error}`` (schema-checked)."""
    return LimitSpec(rate=raw.get("rate", 0), period_ms=int(round(raw.get("per_s", 1) * 1000)),
                     burst=raw.get("burst", 0), concurrency=raw.get("concurrency", 0),
                     on_redis_error=raw.get("on_redis_error", "auto"))


def _positive(raw: str, name: str) -> int:
    if not raw.isdigit() or int(raw) < 1:
        raise LimitSpecError(f"{name}: expected a positive integer, got {raw!r}")
    return int(raw)


def _period_ms(raw: str) -> int:
    match = _PERIOD.match(raw)
    if not match:
        raise LimitSpecError(f"rate period: expected e.g. s, 10s, 500ms, m or h, got {raw!r}")
    amount = float(match.group(1)) if match.group(1) else 1.0
    period = int(math.ceil(amount * _UNIT_MS[match.group(2)]))
    if period < 1:
        raise LimitSpecError(f"rate period: must be positive, got {raw!r}")
    return period


@dataclass(frozen=True)
class QuotaRules:
    """Every configured limit: the registry's per tool and per backend, the configuration's per caller."""

    tools: Mapping[str, LimitSpec]
    backends: Mapping[str, LimitSpec]
    tenant: LimitSpec | None = None
    tenants: Mapping[str, LimitSpec] = None  # type: ignore[assignment]
    subject: LimitSpec | None = None
    fleet: LimitSpec | None = None
    classes: Mapping[str, LimitSpec] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenants", dict(self.tenants or {}))
        object.__setattr__(self, "classes", dict(self.classes or {}))

    @property
    def empty(self) -> bool:
        return not (self.tools or self.backends or self.tenant or self.tenants or self.subject or self.fleet
                    or self.classes)

    def applicable(self, *, tenant: str, subject: str, tool: str, backend: str,
                   quota_class: str | None) -> tuple["AppliedLimit", ...]:
        """The limits of one call, each with the identity its budget is counted by.

        Raises ``KeyError`` for a class no configuration defines (the caller fails closed)."""
        applied: list[AppliedLimit] = []
        cls = self.classes[quota_class] if quota_class is not None else None
        tenant_spec = self.tenants.get(tenant, self.tenant)
        subject_spec = self.subject
        if cls is not None and cls.per == "tenant":
            tenant_spec = cls
        elif cls is not None:
            subject_spec = cls
        if tenant_spec is not None:
            applied.append(AppliedLimit(f"class:{quota_class}", cls, ("class", str(quota_class), tenant))
                           if tenant_spec is cls else AppliedLimit("tenant", tenant_spec, ("tenant", tenant)))
        if subject_spec is not None:
            applied.append(AppliedLimit(f"class:{quota_class}", cls, ("class", str(quota_class), tenant, subject))
                           if subject_spec is cls else
                           AppliedLimit("subject", subject_spec, ("subject", tenant, subject)))
        if tool in self.tools:
            applied.append(AppliedLimit(f"tool:{tool}", self.tools[tool], ("tool", tool)))
        if backend in self.backends:
            applied.append(AppliedLimit(f"backend:{backend}", self.backends[backend], ("backend", backend)))
        if self.fleet is not None:
            applied.append(AppliedLimit("fleet", self.fleet, ("fleet",)))
        return tuple(applied)

    def describe(self) -> dict[str, Any]:
        """What the admin listener shows: every configured limit, none of the counters."""
        return {
            "tenant": self.tenant.describe() if self.tenant else None,
            "tenants": {name: spec.describe() for name, spec in sorted(self.tenants.items())},
            "subject": self.subject.describe() if self.subject else None,
            "fleet": self.fleet.describe() if self.fleet else None,
            "classes": {name: {**spec.describe(), "per": spec.per} for name, spec in sorted(self.classes.items())},
            "tools": {name: spec.describe() for name, spec in sorted(self.tools.items())},
            "backends": {name: spec.describe() for name, spec in sorted(self.backends.items())},
        }


@dataclass(frozen=True)
class AppliedLimit:
    """One limit as it applies to one call: its public name, its spec, and whose budget it counts."""

    name: str                    # tenant | subject | class:<c> | tool:<t> | backend:<b> | fleet (no ids)
    spec: LimitSpec
    counted_by: tuple[str, ...]  # e.g. ("subject", tenant, subject); becomes the Redis key

    def key_suffix(self) -> str:
        return ":".join(quote(part, safe="-_.@") for part in self.counted_by)
