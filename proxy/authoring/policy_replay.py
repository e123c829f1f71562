"""``toolproxy policy replay``: recorded decisions against a candidate policy.

Owns: reading decision records (a Redis Stream, or a JSON-lines file from a
log pipeline, where other lines are skipped), evaluating every recorded input
against a scratch OPA running the candidate (batched), telling which records
are not replayable (input not recorded, or the candidate may read a masked
path: ``policy_reads``), and the report: changed decisions, transitions by
tool, changed reasons, masked examples, and the ``--fail-on`` verdict.
Must never: guess a decision for a record it cannot replay, or print an
unmasked sensitive value (records only hold masked ones).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..wire import redis_py  # noqa: F401  # first: redis-py imported without OpenTelemetry's metrics SDK

import redis.asyncio as redis_async

from ..policy.decisions import RECORD_TYPE
from .policy_reads import (RuleReads, all_patterns, policy_reads, project, residual_needs_input, rules_reaching,
                           trace_reads)
from .policy_scratch import ScratchOpa, rego_ref
from ..store import key

RESULTS = ("allow", "require_approval", "deny")
ANALYSIS_CONCURRENCY = 4


def result_of(decision: Any) -> str:
    if not isinstance(decision, dict):
        return "undefined"
    return "allow" if decision.get("allow") else "require_approval" if decision.get("require_approval") else "deny"


def read_jsonl(lines: Iterable[str]) -> tuple[list[dict[str, Any]], int]:
    """Decision records from JSON lines; other lines (audit records, logs) are counted and skipped."""
    records, skipped = [], 0
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(record, dict) and record.get("record") == RECORD_TYPE:
            records.append(record)
        else:
            skipped += 1
    return records, skipped


async def read_stream(url: str, key: str, *, page: int = 1000) -> tuple[list[dict[str, Any]], int]:
    """The records of the decision stream at ``url``. A password in the URL wins; else
    ``TOOLPROXY_REDIS_PASSWORD`` (and ``TOOLPROXY_REDIS_USERNAME``), as the proxy reads them. A refusal or an
    unreachable server is one line (ValueError) naming the address and how to connect."""
    from redis import exceptions as redis_errors

    client = redis_async.Redis.from_url(url, decode_responses=True,
                                        password=os.environ.get("TOOLPROXY_REDIS_PASSWORD") or None,
                                        username=os.environ.get("TOOLPROXY_REDIS_USERNAME") or None)
    where = _without_password(url)
    lines: list[str] = []
    try:
        start = "-"
        while True:
            entries = await client.xrange(key, min=start, max="+", count=page)
            lines.extend(fields.get("record", "") for _, fields in entries)
            if len(entries) < page:
                break
            start = "(" + entries[-1][0]
    except (redis_errors.AuthenticationError, redis_errors.AuthorizationError, redis_errors.ResponseError) as exc:
        if isinstance(exc, redis_errors.ResponseError) and not any(
                word in str(exc) for word in ("NOAUTH", "WRONGPASS", "NOPERM")):
            raise ValueError(f"Redis at {where} answered an error reading {key}: {exc}") from None
        raise ValueError(f"Redis at {where} refused the read ({exc}): set TOOLPROXY_REDIS_PASSWORD (the dev "
                         f"stack's banner prints its own), or put it in --redis (redis://:PASSWORD@host:port/0)"
                         ) from None
    except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError) as exc:
        raise ValueError(f"cannot reach Redis at {where} (--redis): {exc}") from None
    finally:
        await client.aclose()
    return read_jsonl(lines)


def _without_password(url: str) -> str:
    """The URL as it may be printed: a password in it becomes ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + parts.netloc.rpartition("@")[2]))


async def load_records(args: argparse.Namespace) -> tuple[list[dict[str, Any]], int]:
    """The decision records a policy command reads: ``--records FILE`` (JSON lines) or the Redis stream."""
    if args.records:
        with open(args.records, encoding="utf-8") as handle:
            return read_jsonl(handle)
    return await read_stream(args.redis, args.stream or key(args.key_prefix, "decisions", "stream"))


@dataclass
class Report:
    total: int = 0
    skipped_lines: int = 0
    replayed: int = 0
    changed: int = 0
    not_replayable: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    transitions: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    reasons_added: Counter = field(default_factory=Counter)
    reasons_removed: Counter = field(default_factory=Counter)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    queries: int = 0
    distinct_inputs: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "records": self.total, "skipped_lines": self.skipped_lines, "replayed": self.replayed,
            "distinct_inputs": self.distinct_inputs, "opa_queries": self.queries,
            "changed": self.changed,
            "not_replayable": {why: dict(tools) for why, tools in sorted(self.not_replayable.items())},
            "transitions": {t: dict(sorted(tools.items())) for t, tools in sorted(self.transitions.items())},
            "reasons_added": dict(sorted(self.reasons_added.items())),
            "reasons_removed": dict(sorted(self.reasons_removed.items())),
            "examples": {t: ex for t, ex in sorted(self.examples.items())},
        }

    def failing(self, fail_on: Sequence[str]) -> list[str]:
        wanted = {t.replace(" ", "") for t in fail_on}
        return sorted(t for t in self.transitions if t in wanted or ("any" in wanted and t))


async def replay(records: Sequence[dict[str, Any]], opa: ScratchOpa, reads: Sequence[RuleReads], *,
                 examples: int = 3) -> Report:
    """Replay every record; inputs with equal projections (``policy_reads.project``) are evaluated once."""
    report = Report(total=len(records))
    replayable = await _replayable(records, opa, reads, report)
    unique: dict[str, dict[str, Any]] = {}
    for record, projection in replayable:
        unique.setdefault(projection, record["input"])
    decided = dict(zip(unique, await opa.evaluate(list(unique.values()))))
    for record, projection in replayable:
        _compare(report, record, decided[projection], examples)
    report.queries = opa.queries
    report.distinct_inputs = len(unique)
    return report


async def _replayable(records: Sequence[dict[str, Any]], opa: ScratchOpa, reads: Sequence[RuleReads],
                      report: Report) -> list[tuple[dict[str, Any], str]]:
    """The records that can be replayed, each with its projection projection; the others are counted in the
    report by why (no input recorded; the policy may read a field the record masked)."""
    patterns = all_patterns(reads)
    gate = asyncio.Semaphore(ANALYSIS_CONCURRENCY)
    verdict_of: dict[str, asyncio.Task[str | None]] = {}

    async def analyse(record: dict[str, Any], paths: list[tuple[Any, ...]]) -> str | None:
        async with gate:
            read = await _may_read(opa, reads, record["input"], paths)
        return "reads_masked:" + ",".join(".".join(map(str, p)) for p in read) if read else None

    keyed = [(record, json.dumps(project(record["input"], patterns), sort_keys=True, separators=(",", ":"))
              if "input" in record else None, [tuple(p) for p in record.get("masked_paths") or ()])
             for record in records]
    for record, projection, paths in keyed:  # every masked-read analysis starts before the first is awaited
        if projection is not None and paths and projection + json.dumps(paths) not in verdict_of:
            verdict_of[projection + json.dumps(paths)] = asyncio.ensure_future(analyse(record, paths))
    replayable: list[tuple[dict[str, Any], str]] = []
    for record, projection, paths in keyed:
        why = "input_not_recorded" if projection is None else \
            await verdict_of[projection + json.dumps(paths)] if paths else None
        if why is None:
            replayable.append((record, projection))
        else:
            report.not_replayable[why][_tool(record)] += 1
    return replayable


def _compare(report: Report, record: dict[str, Any], after: Any, examples: int) -> None:
    report.replayed += 1
    before = record["decision"]
    old, new = before["result"], result_of(after)
    old_reasons = set(before.get("reasons") or ())
    new_reasons = set(after.get("reasons") or ()) if isinstance(after, dict) else set()
    if old == new and old_reasons == new_reasons:
        return
    report.changed += 1
    transition = f"{old}->{new}"
    report.transitions[transition][_tool(record)] += 1
    report.reasons_added.update(new_reasons - old_reasons)
    report.reasons_removed.update(old_reasons - new_reasons)
    if len(report.examples[transition]) < examples:
        report.examples[transition].append({
            "decision_id": record.get("decision_id"), "request_id": record.get("request_id"),
            "tool": _tool(record), "tenant": record.get("tenant"), "subject": record.get("subject"),
            "arguments": record["input"].get("arguments"),
            "reasons_before": sorted(old_reasons), "reasons_after": sorted(new_reasons)})


async def _may_read(opa: ScratchOpa, reads: Sequence[RuleReads], document: dict[str, Any],
                    paths: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The masked paths the candidate's decision may depend on for this input (empty: replayable)."""
    candidates = rules_reaching(reads, paths)
    if not candidates:
        return []
    unknowns = [rego_ref(p) for p in paths]
    if all(rule.partially_evaluable for rule in candidates):
        residuals = await asyncio.gather(*(opa.partial(rule.document, document, unknowns)
                                           for rule in candidates))
        if not any(residual_needs_input(r) for r in residuals):
            return []
    trace = await opa.decide(document, explain=True)
    explanation = trace.get("explanation") or []
    return [p for p in paths if trace_reads(explanation, [p])]


def _tool(record: dict[str, Any]) -> str:
    return record.get("tool") or f"({record.get('action', '?')})"


def render_text(report: Report, fail: Sequence[str]) -> str:
    out = _summary_lines(report)
    for section in (_transition_lines(report), _reason_lines(report), _not_replayable_lines(report),
                    *(_example_lines(t, items) for t, items in sorted(report.examples.items())),
                    _fail_lines(report, fail)):
        if section:
            out += ["", *section]
    return "\n".join(out)


def _summary_lines(report: Report) -> list[str]:
    skipped = (f"   (skipped {report.skipped_lines} lines that are not decision records)"
               if report.skipped_lines else "")
    return [f"records: {report.total}   replayed: {report.replayed}   changed: {report.changed}   "
            f"not replayable: {sum(sum(c.values()) for c in report.not_replayable.values())}" + skipped,
            f"({report.distinct_inputs} distinct inputs as far as the policy reads them; {report.queries} OPA queries)"]


def _transition_lines(report: Report) -> list[str]:
    if not report.transitions:
        return []
    return [f"{'transition':<30} {'tool':<24} {'count':>6}"] + [
        f"{transition:<30} {tool:<24} {count:>6}"
        for transition, tools in sorted(report.transitions.items()) for tool, count in sorted(tools.items())]


def _reason_lines(report: Report) -> list[str]:
    if not (report.reasons_added or report.reasons_removed):
        return []
    return (["changed reasons:"] + [f"  + {r}  ({n})" for r, n in sorted(report.reasons_added.items())]
            + [f"  - {r}  ({n})" for r, n in sorted(report.reasons_removed.items())])


def _not_replayable_lines(report: Report) -> list[str]:
    if not report.not_replayable:
        return []
    return ["not replayable:"] + [f"  {why}: " + ", ".join(f"{t} {n}" for t, n in sorted(tools.items()))
                                  for why, tools in sorted(report.not_replayable.items())]


def _example_lines(transition: str, items: Sequence[dict[str, Any]]) -> list[str]:
    out = [f"examples of {transition}:"]
    for item in items:
        out.append(f"  {item['decision_id'] or item['request_id'] or '-'} {item['tool']} tenant={item['tenant']} "
                   f"subject={item['subject']} arguments={json.dumps(item['arguments'], sort_keys=True)}")
        out.append(f"    reasons {item['reasons_before']} -> {item['reasons_after']}")
    return out


def _fail_lines(report: Report, fail: Sequence[str]) -> list[str]:
    return ["FAIL: " + ", ".join(f"{t} ({sum(report.transitions[t].values())})" for t in fail)] if fail else []


async def run(*, records: Sequence[dict[str, Any]], skipped: int, policy_dir: str, data_paths: Sequence[str],
              catalog: dict[str, Any] | None, decision_path: str, opa_binary: str | None,
              examples: int) -> Report:
    async with ScratchOpa(policy_dir, data_paths, decision_path=decision_path, opa_binary=opa_binary,
                          catalog=catalog) as opa:
        reads = policy_reads(policy_dir, opa.binary)
        report = await replay(records, opa, reads, examples=examples)
    report.skipped_lines = skipped
    return report
