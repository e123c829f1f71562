"""``toolproxy policy replay | explain | check``: the commands policy authors run.

Owns: turning parsed arguments into a run of ``policy_replay``,
``policy_explain`` or ``policy_check`` and their exit codes (0: fine, 1: the
gate failed or problems were found, 2: the command could not run).
Must never: touch the proxy's own OPA or Redis state (replay only reads the
decision stream).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from ..policy.opa_control import ControlError
from ..policy.client import catalog_document
from ..registry import RegistryError, load_registry


def add_parsers(sub: Any) -> None:
    policy = sub.add_parser("policy", help="policy authoring: replay, explain, check",
                            description="Tools for policy authors; see docs/policy-authors.md.")
    commands = policy.add_subparsers(dest="policy_command", required=True)

    replay = commands.add_parser(
        "replay", help="replay recorded decisions against a candidate policy",
        description="Evaluate recorded decision inputs against a candidate policy in a scratch opa and report "
                    "what would change. Exit 1 when a --fail-on transition occurs, 2 when it cannot run.")
    source = replay.add_mutually_exclusive_group(required=True)
    source.add_argument("--records", help="JSON-lines file of decision records (other lines are skipped)")
    source.add_argument("--redis", help="Redis URL holding the decision stream")
    replay.add_argument("--stream", default=None,
                        help="stream key (default: <prefix>:decisions:{stream} with --key-prefix)")
    replay.add_argument("--key-prefix", default="toolproxy", help="redis.key_prefix of the proxy (default toolproxy)")
    _policy_args(replay)
    replay.add_argument("--fail-on", action="append", default=[],
                        help="exit 1 if this transition occurs, e.g. deny->allow (repeatable; 'any' for every change)")
    replay.add_argument("--format", choices=["text", "json"], default="text")
    replay.add_argument("--examples", type=int, default=3, help="examples per transition (default 3)")

    explain = commands.add_parser(
        "explain", help="why a call or a listing is decided the way it is: the input, the decision, which rules "
                   "applied, the rules behind each reason")
    what = explain.add_mutually_exclusive_group(required=True)
    what.add_argument("--body", help="a tool-call request body (JSON file, or - for stdin)")
    what.add_argument("--decision-id", help="a decision id from the records (with --records or --redis)")
    what.add_argument("--list", action="store_true",
                      help="a tool listing (tools/list) for the caller: which tools are shown, which hidden and why")
    explain.add_argument("--records", help="JSON-lines file of decision records (with --decision-id)")
    explain.add_argument("--redis", help="Redis URL holding the decision stream (with --decision-id)")
    explain.add_argument("--stream", default=None)
    explain.add_argument("--key-prefix", default="toolproxy")
    explain.add_argument("--subject", default="dev-user")
    explain.add_argument("--tenant", default="acme")
    explain.add_argument("--roles", default="agent", help="comma-separated roles")
    explain.add_argument("--scopes", default="tools:read,tools:write", help="comma-separated scopes")
    explain.add_argument("--agent", default="dev-agent")
    explain.add_argument("--flow", default=None, metavar="LABELS",
                         help="with --body: comma-separated flow labels the agent was exposed to (input.flow; an "
                              "external sink gets an empty one without it, as the proxy reads it)")
    _policy_args(explain)
    explain.add_argument("--listing-path", default="toolproxy/listing",
                         help="the listing rules' document (default toolproxy/listing: policies/listing.rego)")
    explain.add_argument("--format", choices=["text", "json"], default="text")

    check = commands.add_parser(
        "check", help="opa check --strict, opa fmt, and policy data against the registry",
        description="Exit 1 when any problem is found, 2 when the check cannot run.")
    check.add_argument("--policy", default="policies", help="Rego directory (default policies/)")
    check.add_argument("--data", nargs="+", default=["examples/opa"], help="OPA data files or directories")
    check.add_argument("--registry", nargs="+", default=["examples/registry"], help="registry files or directories")
    check.add_argument("--opa", help="opa binary (default: the venv's, then PATH)")
    check.add_argument("--format", choices=["text", "json"], default="text")


def _policy_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default="policies", help="candidate Rego directory (default policies/)")
    parser.add_argument("--data", nargs="*", default=["examples/opa"], help="OPA data files or directories")
    parser.add_argument("--registry", nargs="*", default=["examples/registry"],
                        help="registry loaded as data.toolproxy.catalog (none: the data ships the catalog)")
    parser.add_argument("--decision-path", default="toolproxy/decision", help="opa.decision_path of the proxy")
    parser.add_argument("--opa", help="opa binary (default: the venv's, then PATH)")


def run(args: argparse.Namespace) -> int:
    try:
        if args.policy_command == "replay":
            return asyncio.run(_replay(args))
        if args.policy_command == "explain":
            return asyncio.run(_explain(args))
        if args.policy_command == "check":
            from .policy_check import run_check
            return run_check(args)
    except (ControlError, RegistryError, OSError, ValueError) as exc:
        print(f"toolproxy policy {args.policy_command}: {exc}", file=sys.stderr)
        return 2
    return 2


def _catalog(args: argparse.Namespace) -> dict[str, Any] | None:
    return catalog_document(load_registry(args.registry)) if args.registry else None


async def _replay(args: argparse.Namespace) -> int:
    from .policy_replay import load_records, render_text, run as run_replay
    records, skipped = await load_records(args)
    report = await run_replay(records=records, skipped=skipped, policy_dir=args.policy, data_paths=args.data,
                              catalog=_catalog(args), decision_path=args.decision_path, opa_binary=args.opa,
                              examples=args.examples)
    failing = report.failing(args.fail_on)
    if args.format == "json":
        print(json.dumps({**report.to_json(), "failed_on": failing}, indent=2, sort_keys=True))
    else:
        print(render_text(report, failing))
    return 1 if failing else 0


async def _explain(args: argparse.Namespace) -> int:
    from .policy_explain import explain, render_text
    result = await explain(args, catalog=_catalog(args))
    print(json.dumps(result, indent=2, sort_keys=True) if args.format == "json" else render_text(result))
    return 0
