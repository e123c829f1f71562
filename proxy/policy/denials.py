"""Recent policy denials, for the people who watch them (the operator console).

Owns: capped Redis lists of the latest calls OPA denied (the fleet's, and
each tenant's beside it, so a noisy tenant cannot push another's out) (when, tenant,
subject, tool and version, the policy's reasons, decision id and policy
revision, request and call ids) and their summary by tool and reason, and the
``toolproxy_policy_denials_total{tool, reason}`` counter. The lists live
per proxy prefix, shared by every replica, so the console sees the fleet's
denials, not one process's. Must never: change or delay a decision (recording
is best effort: a Redis failure is logged and the denial stands), hold
argument values (the reasons and ids are enough to find the audit record), or
show one tenant's denials to another tenant's admin.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from typing import Any


from ..telemetry.metrics import Metrics
from ..store import Client, key, logged_on_fault, redis_call

log = logging.getLogger("toolproxy.denials")

KEEP = 500  # denials kept; the console summarizes these
_REASON_CODE = re.compile(r"[a-z][a-z0-9_.-]{0,63}")


def reason_code(reason: str) -> str:
    """A bounded label from a policy reason: ``resource_not_owned:order:ord_9`` -> ``resource_not_owned``."""
    code = reason.split(":", 1)[0]
    return code if _REASON_CODE.fullmatch(code) else "other"


class DenialLog:
    def __init__(self, redis: Client, prefix: str, metrics: Metrics) -> None:
        self._redis = redis
        self._metrics = metrics
        self._prefix = prefix
        self._key = key(prefix, "denials", "recent")  # the fleet's latest (an operator of every tenant)

    def _tenant_key(self, tenant: str) -> str:
        """One tenant's latest, kept beside the fleet's list: a noisy tenant's denials never push another
        tenant's out of what its admin sees."""
        return key(self._prefix, "denials", tenant, "recent")

    async def record(self, *, tenant: str, subject: str, tool: str, tool_version: str, reasons: tuple[str, ...],
                     decision_id: str | None, policy_revision: str | None, request_id: str,
                     call_id: str | None, trace_id: str | None = None) -> None:
        for code in sorted({reason_code(r) for r in reasons} or {"none"}):
            self._metrics.policy_denials.labels(tool, code).inc()
        entry = json.dumps({"at_ms": int(time.time() * 1000), "tenant": tenant, "subject": subject, "tool": tool,
                            "tool_version": tool_version, "reasons": list(reasons), "decision_id": decision_id,
                            "policy_revision": policy_revision, "request_id": request_id, "call_id": call_id,
                            "trace_id": trace_id},
                           separators=(",", ":"))
        with logged_on_fault(log, "could not record a denial for the console (the call is denied all the same)"):
            for list_key in (self._key, self._tenant_key(tenant)):  # two slots in Cluster: one MULTI each
                async with self._redis.pipeline(transaction=True) as pipe:
                    pipe.lpush(list_key, entry)
                    pipe.ltrim(list_key, 0, KEEP - 1)
                    await redis_call(pipe.execute())

    async def recent(self, *, tenant: str | None, limit: int = 100) -> dict[str, Any]:
        """The latest denials (newest first, at most ``limit``) and counts by (tool, reason) over all kept."""
        source = self._key if tenant is None else self._tenant_key(tenant)
        entries = [json.loads(raw) for raw in await redis_call(self._redis.lrange(source, 0, KEEP - 1))]
        visible = [e for e in entries if tenant is None or e["tenant"] == tenant]
        counts: Counter[tuple[str, str]] = Counter()
        last: dict[tuple[str, str], int] = {}
        examples: dict[tuple[str, str], list[str]] = {}
        for entry in visible:
            for reason in entry["reasons"] or ["none"]:
                group = (entry["tool"], reason_code(reason))
                counts[group] += 1
                last.setdefault(group, entry["at_ms"])
                seen = examples.setdefault(group, [])
                if reason not in seen and len(seen) < 5:
                    seen.append(reason)
        return {"by_tool_and_reason": [{"tool": tool, "reason": code, "count": n, "last_at_ms": last[(tool, code)],
                                        "examples": examples[(tool, code)]}
                                       for (tool, code), n in counts.most_common()],
                "recent": visible[:limit], "kept": KEEP, "counted": len(visible)}
