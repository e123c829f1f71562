"""``toolproxy policy replay | explain | check``: the commands policy authors run.

Owns: turning parsed arguments into a run of ``policy_replay``,
``policy_explain`` or ``policy_check`` and their exit codes (0: fine, 1: the
gate failed or problems were found, 2: the command could not run); their
arguments are declared in ``proxy/cli.py``, so that ``toolproxy run`` never imports this module.
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
