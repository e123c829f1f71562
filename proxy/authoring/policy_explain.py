"""``toolproxy policy explain``: the input, the decision, which rules applied, and the rules behind each reason.

Owns: building the OPA input for one call exactly as the proxy would
(registry resolve, strict decode, normalize, ``policy.build_input``) from a
request body and a caller identity, or for one listing (``--list``: the
registry's active tools, as ``policy/listing`` asks), or taking a recorded
input by decision id (or request id); evaluating it with ``opa eval --explain
full`` and naming, for each reason, the rule definitions (package, rule,
file:line, source line) whose evaluation produced that value. Listing and
calling have their own rules: the explanation says which applied (the input's
action), and for a call whether its tool is listed for that caller, and why not
(``data.toolproxy.listing.hidden``, the ``--listing-path`` document). ``opa eval`` and not the scratch
server: OPA's REST API returns the trace without source locations.
Must never: invent a provenance (a reason no traced rule produced is listed
as "not traced").
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..decode import decode_arguments
from ..errors import ProxyError
from ..identity import Caller
from ..normalize import normalize
from ..policy.opa_control import ControlError
from .. import provenance as value_provenance
from ..flow import LABELS, FlowState, Seen
from ..policy.client import RequestFacts, build_input
from .policy_replay import result_of
from .policy_scratch import POLICY_ERROR, find_opa
from ..registry import load_registry


def call_input(body: dict[str, Any], caller: Caller, registry_paths: list[str], catalog_digest: str,
               flow_labels: list[str] | None = None) -> dict[str, Any]:
    """The input the proxy would build; ``input.flow`` as the proxy reads it for an external sink (or with
    ``flow_labels``): those labels in the principal scope, no run scope (``--flow``)."""
    registry = load_registry(registry_paths)
    try:
        tool = registry.resolve(body.get("tool"), body.get("version"))
        normalized = normalize(tool, decode_arguments(body.get("arguments"), tool.input_validator))
    except ProxyError as error:
        raise ValueError(f"the call would not reach the policy: {error.code}: {error.message}") from None
    request = RequestFacts(request_id=str(body.get("request_id") or "explain"), call_id=body.get("call_id"))
    flow = None
    if flow_labels is not None or tool.flow_sink == "external" or tool.flow_sink_arguments:
        unknown = sorted(set(flow_labels or ()) - set(LABELS))
        if unknown:
            raise ValueError(f"--flow: unknown label {unknown[0]!r} (known: {', '.join(LABELS)})")
        now_ms = int(time.time() * 1000)
        provenance_entries = None
        if tool.flow_sink_arguments:  # values the explained context never saw: "unseen"
            values, cut = value_provenance.sink_values(normalized.arguments, tool.flow_sink_arguments)
            nothing_seen = [None] * (2 * sum(len(v.candidates) for v in values) + 1)  # (lookup_fields' replies)
            provenance_entries = tuple(value_provenance.entries(values, nothing_seen, task=None, now_ms=now_ms,
                                                                window_ms=86400_000, truncated=cut))
        flow = FlowState(principal=tuple(Seen(label, "explain", now_ms) for label in sorted(set(flow_labels or ()))),
                         run=None, window_s=86400, provenance=provenance_entries).policy_input()
    return build_input("call", caller, request, catalog_digest=catalog_digest, tool=tool, normalized=normalized,
                       flow=flow)


async def explain(args: argparse.Namespace, *, catalog: dict[str, Any] | None) -> dict[str, Any]:
    caller = Caller(subject=args.subject, tenant=args.tenant, roles=tuple(_list(args.roles)),
                    scopes=tuple(_list(args.scopes)), agent=args.agent, source="jwt")
    document, masked = await _input_to_explain(args, caller, catalog)
    listing_path = getattr(args, "listing_path", LISTING_PATH)
    evaluated = {"policy_dir": args.policy, "data_paths": args.data, "catalog": catalog, "opa_binary": args.opa}
    listing = _listing_view(document, listing_path=listing_path, **evaluated)
    reasons = sorted({r for why in (listing or {}).get("hidden", {}).values() for r in why}) \
        if document.get("action") == "list" else None
    decision, provenance = evaluate(document, decision_path=args.decision_path, extra_reasons=reasons, **evaluated)
    return {"input": document, "masked_paths": masked, "decision": decision, "result": result_of(decision),
            "provenance": provenance, "rules": applied_rules(document, args.decision_path, listing_path, listing)}


async def _input_to_explain(args: argparse.Namespace, caller: Caller,
                            catalog: dict[str, Any] | None) -> tuple[dict[str, Any], list[Any]]:
    """The input to explain and its masked paths: a recorded decision's (``--decision-id``), a listing's
    (``--list``), or a call body's (``--body``)."""
    if args.decision_id:
        return await _recorded_input(args)
    digest = (catalog or {}).get("digest", "")
    if getattr(args, "list", False):
        registry = load_registry(args.registry or ["examples/registry"])
        return build_input("list", caller, RequestFacts(request_id="explain"), catalog_digest=digest,
                           tools=registry.active()), []
    text = Path(args.body).read_text(encoding="utf-8") if args.body != "-" else sys.stdin.read()
    flow = _list(args.flow) if getattr(args, "flow", None) is not None else None
    return call_input(json.loads(text), caller, args.registry or ["examples/registry"], digest, flow), []


async def _recorded_input(args: argparse.Namespace) -> tuple[dict[str, Any], list[Any]]:
    from .policy_replay import load_records
    if not (args.records or args.redis):
        raise ValueError("--decision-id needs --records FILE or --redis URL")
    records, _ = await load_records(args)
    found = [r for r in records if args.decision_id in (r.get("decision_id"), r.get("request_id"))]
    if not found:
        raise ValueError(f"no decision record with decision or request id {args.decision_id!r}")
    if "input" not in found[-1]:
        raise ValueError("that record holds no input (it was larger than decisions.max_record_bytes)")
    return found[-1]["input"], found[-1].get("masked_paths") or []


LISTING_PATH = "toolproxy/listing"


def applied_rules(document: dict[str, Any], decision_path: str, listing_path: str,
                  listing: dict[str, Any] | None) -> dict[str, Any]:
    """Which rules decided: the listing rules for a listing, the call rules for anything else; for a call,
    whether its tool is listed for that caller (listing and calling may differ)."""
    action = document.get("action")
    decision_ref = "data." + decision_path.strip("/").replace("/", ".")
    listing_ref = "data." + listing_path.strip("/").replace("/", ".")
    if action == "list":
        hidden = (listing or {}).get("hidden", {})
        names = [t.get("name") for t in document.get("tools") or []]
        return {"applied": "listing", "action": action, "rules": f"{listing_ref}.visible, through {decision_ref}",
                "listed": [n for n in names if n not in hidden], "hidden": hidden}
    out: dict[str, Any] = {"applied": "call", "action": action, "rules": decision_ref}
    tool = (document.get("tool") or {}).get("name")
    if tool and listing is not None:
        why = listing.get("hidden", {}).get(tool)
        out["listing"] = {"tool": tool, "listed": not why, "hidden_because": why or [],
                          "rules": f"{listing_ref}.visible"}
    return out


def _listing_view(document: dict[str, Any], *, policy_dir: str, data_paths: list[str], catalog: dict[str, Any] | None,
                  opa_binary: str | None, listing_path: str) -> dict[str, Any] | None:
    """``{"hidden": {tool: [reasons]}}`` of the listing rules for this input's caller (for a call: a listing of
    its one tool); None when the policy has no listing document at ``listing_path``."""
    if document.get("action") == "list":
        listed = document
    elif isinstance(document.get("tool"), dict) and document.get("action") == "call":
        tool = document["tool"]
        listed = {key: document[key] for key in ("subject", "agent", "catalog_digest", "request") if key in document}
        listed.update({"action": "list", "tools": [{k: tool.get(k) for k in ("name", "version", "mode", "risk")}]})
    else:
        return None
    try:
        answer = _opa_eval(listed, policy_dir=policy_dir, data_paths=data_paths, catalog=catalog,
                           query="data." + listing_path.strip("/").replace("/", "."), opa_binary=opa_binary,
                           explain=False)
    except EvalError:
        return None
    rows = answer.get("result") or []
    value = rows[0]["expressions"][0]["value"] if rows else None
    if not isinstance(value, dict):
        return None
    hidden = value.get("hidden") if isinstance(value.get("hidden"), dict) else {}
    return {"hidden": {str(name): sorted(reasons) for name, reasons in sorted(hidden.items())}}


def evaluate(document: dict[str, Any], *, policy_dir: str, data_paths: list[str], catalog: dict[str, Any] | None,
             decision_path: str, opa_binary: str | None,
             extra_reasons: list[str] | None = None) -> tuple[Any, dict[str, list[dict[str, Any]]]]:
    """The decision and, for each of its reasons (plus ``extra_reasons``: a listing's hidden reasons), the
    rules that produced it."""
    try:
        answer = _opa_eval(document, policy_dir=policy_dir, data_paths=data_paths, catalog=catalog,
                           query="data." + ".".join(decision_path.strip("/").split("/")), opa_binary=opa_binary,
                           explain=True)
    except EvalError as erred:  # the proxy's answer: forbidden, details.reason policy_error
        return dict(POLICY_ERROR), {"policy_error": [
            {"rule": f"evaluation error {e.get('code')}", "location": f"{_where(e)[0]}:{_where(e)[1]}",
             "source": _line(*_where(e))} for e in erred.errors]}
    rows = answer.get("result") or []
    decision = rows[0]["expressions"][0]["value"] if rows else None
    reasons = (decision or {}).get("reasons") or [] if isinstance(decision, dict) else []
    return decision, provenance(answer.get("explanation") or [], [*reasons, *(extra_reasons or [])])


def _opa_eval(document: dict[str, Any], *, policy_dir: str, data_paths: list[str], catalog: dict[str, Any] | None,
              query: str, opa_binary: str | None, explain: bool) -> dict[str, Any]:
    binary = find_opa(opa_binary)
    with tempfile.TemporaryDirectory(prefix="toolproxy-explain-") as scratch:
        input_path = Path(scratch) / "input.json"
        input_path.write_text(json.dumps(document))
        extra: list[str] = []
        if catalog is not None:
            catalog_dir = Path(scratch) / "catalog" / "toolproxy" / "catalog"
            catalog_dir.mkdir(parents=True)
            (catalog_dir / "data.json").write_text(json.dumps(catalog))
            extra = ["-d", str(Path(scratch) / "catalog")]
        data = [arg for path in [policy_dir, *data_paths] for arg in ("-d", path)]
        done = subprocess.run([binary, "eval", "--format", "json", "--strict-builtin-errors",
                               *(["--explain", "full"] if explain else []), *data, *extra,
                               "-i", str(input_path), query], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        erred = _eval_errors(done.stdout)
        if erred:
            raise EvalError(erred)
        raise ControlError("opa eval failed: " + (done.stderr.strip().splitlines() or ["(no output)"])[-1])
    return json.loads(done.stdout)


class EvalError(Exception):
    """The policy erred evaluating this input (``eval_*``): the proxy denies such a call."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(errors[0].get("code"))
        self.errors = errors


def _eval_errors(stdout: str) -> list[dict[str, Any]]:
    try:
        answer = json.loads(stdout)
    except ValueError:
        return []
    errors = answer.get("errors") if isinstance(answer, dict) else None
    return [e for e in errors or [] if isinstance(e, dict) and str(e.get("code", "")).startswith("eval_")]


def provenance(trace: list[dict[str, Any]], reasons: list[str]) -> dict[str, list[dict[str, Any]]]:
    """For each reason, the rule definitions whose successful evaluation produced it."""
    found: dict[str, list[dict[str, Any]]] = {reason: [] for reason in reasons}
    seen: set[tuple[str, str, int]] = set()
    packages: dict[str, str] = {}
    for event in trace:
        node = event.get("Node")
        if event.get("Op") != "Exit" or not isinstance(node, dict) or "head" not in node:
            continue
        head = node["head"]
        value = _key_value(head.get("key") or head.get("value"), event.get("Locals") or [])
        if value not in found:
            continue
        location = event.get("Location") or {}
        file, row = location.get("file", ""), int(location.get("row", 0))
        if (value, file, row) in seen:
            continue
        seen.add((value, file, row))
        found[value].append({"rule": f"{_package(file, packages)}.{_rule_name(head)}",
                             "location": f"{file}:{row}", "source": _line(file, row)})
    return found


def _where(error: dict[str, Any]) -> tuple[str, int]:
    location = error.get("location") if isinstance(error.get("location"), dict) else {}
    return str(location.get("file", "?")), int(location.get("row", 0) or 0)


def _rule_name(head: dict[str, Any]) -> str:
    """``deny`` for ``deny contains ...``, ``hidden`` for ``hidden[tool.name] contains ...`` (a ref head)."""
    if head.get("name"):
        return str(head["name"])
    ref = head.get("ref") or []
    return str(ref[0].get("value", "?")) if ref and isinstance(ref[0], dict) else "?"


def _key_value(term: Any, local_vars: list[dict[str, Any]]) -> Any:
    if not isinstance(term, dict):
        return None
    if term.get("type") == "string":
        return term["value"]
    if term.get("type") == "var":
        for local in local_vars:
            if local.get("name") == term["value"] and isinstance(local.get("value"), str):
                return local["value"]
    return None


def _package(file: str, cache: dict[str, str]) -> str:
    if file not in cache:
        try:
            match = re.search(r"^package\s+([\w.]+)", Path(file).read_text(encoding="utf-8"), re.M)
        except OSError:
            match = None
        cache[file] = match.group(1) if match else "?"
    return cache[file]


def _line(file: str, row: int) -> str:
    try:
        return Path(file).read_text(encoding="utf-8").splitlines()[row - 1].strip()
    except (OSError, IndexError):
        return ""


def _render_rules(rules: dict[str, Any]) -> list[str]:
    if rules.get("applied") == "listing":
        out = [f"rules applied: the listing rules ({rules['rules']}), action \"list\"",
               "listed: " + (", ".join(rules["listed"]) or "none")]
        for name, why in rules["hidden"].items():
            out.append(f"hidden: {name}: {', '.join(why)}")
        return out
    out = [f"rules applied: the call rules ({rules.get('rules')}), action {json.dumps(rules.get('action'))}"]
    listing = rules.get("listing")
    if listing:
        out.append(f"listing: {listing['tool']} is listed for this caller ({listing['rules']})" if listing["listed"]
                   else f"listing: {listing['tool']} is hidden from this caller's listing: "
                        f"{', '.join(listing['hidden_because'])} ({listing['rules']})")
    return out


def _list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def render_text(result: dict[str, Any]) -> str:
    decision = result["decision"] if isinstance(result["decision"], dict) else {}
    out = ["input (what the proxy sends to OPA):", json.dumps(result["input"], indent=2, sort_keys=True), ""]
    if result["masked_paths"]:
        out.append("masked in the record: " + ", ".join(".".join(map(str, p)) for p in result["masked_paths"]))
    out.append(f"decision: {result['result']}   risk: {decision.get('risk', '-')}   "
               f"policy revision: {decision.get('policy_revision', '-')}")
    out.extend(_render_rules(result.get("rules") or {}))
    if not result["provenance"]:
        out.append("reasons: none")
    for reason, rules in result["provenance"].items():
        out.append(f"reason {reason}")
        if not rules:
            out.append("    (not traced to a rule)")
        for rule in rules:
            out.append(f"    {rule['rule']}  {rule['location']}")
            out.append(f"      {rule['source']}")
    return "\n".join(out)
