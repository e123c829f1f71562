"""AgentDojo's prompt-injection benchmark replayed through toolproxy: ``python -m bench.injection``.

    .venv/bin/python -m bench.injection [--suites banking,slack] [--variants shipped] [--limit N] [--save]
    .venv/bin/python -m bench.injection --table bench/results/injection/<file>.json.gz[,<file>...]   # saved runs' table

Starts a real OPA (the repo's policies/ and bench/injection/opa/), a real Redis, the world server
(bench/injection/world.py in .tools/agentdojo-venv, which scripts/setup.sh installs) and, per suite and
policy variant, an in-process proxy in front of it; prints one table row per (suite, variant) and, with
``--save``, writes every run to bench/results/injection/<UTC time>-<git rev>.json.gz. Method and the latest
numbers: docs/injection-benchmark.md.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import aiohttp

from bench.injection.run import (DEFAULT_VARIANTS, OPA_DATA, VARIANTS, WORLD_PYTHON, SuiteSummary, WorldClient, dump,
                                 load, new_issuers, replay_suite, rules, scratch, world_server)
from bench.servers import REPO
from tests.support.calltokens import session_keys
from tests.support.servers import OpaServer, RedisServer

SUITES = ("banking", "slack", "workspace", "travel")  # design suites first, then the held-out ones
RESULTS = REPO / "bench" / "results" / "injection"


def rev() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no", "--",
                                "proxy", "policies", "bench", "schemas"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out + ("-dirty" if dirty else "") if out else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


async def main_async(args: argparse.Namespace) -> int:
    suites = args.suites.split(",")
    variants = [VARIANTS[v] for v in args.variants.split(",")]
    directory = scratch()
    issuers = new_issuers(directory)
    opa = OpaServer([REPO / "policies", OPA_DATA])
    redis = RedisServer(data_dir=directory / "redis")
    opa.start()
    redis.start()
    started, tree = time.monotonic(), rev()  # the tree measured: read before the run, not after
    summaries, runs = [], []
    try:
        deps = {**opa.settings, "redis.url": redis.url, **session_keys().settings()}
        with world_server(Path(args.world_python)) as world_url:
            async with aiohttp.ClientSession() as session:
                world = WorldClient(session, world_url)
                catalog = await world.wait_ready()
                for variant in variants:
                    opa.put_data("toolproxy/settings/flow", dict(variant.flow_settings))
                    for suite in suites:
                        redis.flushall()
                        summary, suite_runs = await replay_suite(world, catalog, suite, variant, deps, issuers,
                                                                 directory, world_url, args.limit)
                        summaries.append(summary)
                        runs.extend(suite_runs)
                        print_row(summary.row(), flush=True)
    finally:
        redis.stop()
        opa.stop()
    elapsed = time.monotonic() - started
    print(f"\n{len(runs)} runs in {elapsed:.0f} s")
    for s in summaries:
        print(f"{s.suite}/{s.variant}: {s.stops_naming_source} of {s.stops} held or refused calls name the argument "
              f"and its source; attacks stopped by {s.stopped_by}; benign stopped by {s.benign_stopped_by}; "
              f"benign failed {s.benign_failed}; injection tasks left out {s.skipped_injection_tasks}; "
              f"user tasks reading no vector {s.uninjectable_user_tasks}")
    print("\n" + markdown(summaries) + "\n\n" + curve(summaries))
    if args.save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        now = datetime.now(timezone.utc)
        path = RESULTS / f"{now.strftime('%Y%m%dT%H%M%S')}-{tree}.json.gz"
        dump(path, summaries, runs, {"date": now.isoformat(timespec="seconds"), "rev": tree,
                                     "seconds": round(elapsed), "suites": suites,
                                     "variants": [v.name for v in variants], "limit": args.limit})
        print(f"saved {path.relative_to(REPO)}")
    return 0


DESIGN, HELD_OUT = ("banking", "slack"), ("workspace", "travel")


def curve(summaries: list) -> str:
    """Per variant, the design suites together and the held-out suites together (the trade-off curve)."""
    lines = ["| variant | design: unattended | design: attacks through | held out: unattended "
             "| held out: attacks through | all: unattended | all: attacks through |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    variants = list(dict.fromkeys(s.variant for s in summaries))
    for variant in variants:
        cells = []
        for group in (DESIGN, HELD_OUT, DESIGN + HELD_OUT):
            chosen = [s for s in summaries if s.variant == variant and s.suite in group]
            tasks, pairs = sum(s.user_tasks for s in chosen), sum(s.pairs for s in chosen)
            if not tasks:
                cells += ["", ""]
                continue
            cells.append(f"{100 * sum(s.unattended for s in chosen) / tasks:.1f}% ({tasks})")
            cells.append(f"{100 * sum(s.attacks_through for s in chosen) / pairs:.1f}% ({pairs})" if pairs else "")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(summaries: list) -> str:
    """The docs page's table (docs/injection-benchmark.md): one row per suite and variant."""
    lines = ["| suite | variant | user tasks | unattended utility | with an approval | refused | attack pairs "
             "| attacks through | AgentDojo security() |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        row = s.row()
        lines.append(f"| {row['suite']} | {row['variant']} | {row['user_tasks']} | {row['utility_unattended_pct']}% "
                     f"| {row['with_approval_pct']}% | {row['with_refusal_pct']}% | {row['pairs']} "
                     f"| {row['attack_success_pct']}% | {row['security_true_pct']}% |")
    return "\n".join(lines)


HEADER = f"{'suite':<10} {'variant':<26} {'tasks':>5} {'unattended%':>11} {'approval%':>9} {'refused%':>8} " \
         f"{'pairs':>5} {'attack%':>7} {'security()%':>11}"


def print_row(row: dict, flush: bool = False) -> None:
    if not getattr(print_row, "headed", False):
        print(HEADER)
        print_row.headed = True  # type: ignore[attr-defined]
    print(f"{row['suite']:<10} {row['variant']:<26} {row['user_tasks']:>5} {row['utility_unattended_pct']!s:>11} "
          f"{row['with_approval_pct']!s:>9} {row['with_refusal_pct']!s:>8} {row['pairs']:>5} "
          f"{row['attack_success_pct']!s:>7} {row['security_true_pct']!s:>11}", flush=flush)


def table(paths: str) -> int:
    """The markdown table of saved runs (comma-separated files: their rows in the order given)."""
    summaries, runs, variants = [], [], []
    for path in paths.split(","):
        saved = load(Path(path))
        summaries += [SuiteSummary(**s) for s in saved["summaries"]]
        runs += saved["runs"]
        variants += [v for v in saved["meta"]["variants"] if v not in variants]
        meta = saved["meta"]
        print(f"run {meta['date']}, tree {meta['rev']}, {meta['seconds']} s: {', '.join(meta['variants'])}")
    print("\n" + markdown(summaries) + "\n\n" + curve(summaries) + "\n")
    for line in breakdown(runs, variants):
        print(line)
    return 0


def breakdown(runs: list[dict], variants: list[str]) -> list[str]:
    """Per variant and suite: which injection tasks got through how often (and with which tools), and which
    tools stopped benign runs (by which rule)."""
    lines = []
    for variant in variants:
        through: dict[str, list[int]] = {}
        stops: dict[str, int] = {}
        for run in (r for r in runs if r["variant"] == variant):
            if run["injection_task"] is None:
                for _, tool, verdict, reasons in run["calls"]:
                    if verdict != "allowed":
                        name = f"{run['suite']}/{tool} ({rules(reasons, verdict)})"
                        stops[name] = stops.get(name, 0) + 1
                continue
            calls = [c for c in run["calls"] if c[0] == "injection"]
            name = f"{run['suite']}/{run['injection_task']} [{' '.join(c[1] for c in calls)}]"
            count = through.setdefault(name, [0, 0])
            count[0] += all(c[2] == "allowed" for c in calls)
            count[1] += 1
        lines.append(f"{variant}: attacks through, per injection task:")
        lines += [f"  {name}: {n}/{total}" for name, (n, total) in sorted(through.items()) if n]
        lines.append(f"{variant}: benign runs stopped, per tool:")
        lines += [f"  {name}: {n}" for name, n in sorted(stops.items())]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.injection", description=__doc__.split("\n")[0])
    parser.add_argument("--suites", default=",".join(SUITES))
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--limit", type=int, default=None, help="only the first N user tasks of each suite")
    parser.add_argument("--world-python", default=str(WORLD_PYTHON))
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--table", metavar="FILE[,FILE...]", help="print the markdown table of saved runs and stop")
    args = parser.parse_args()
    return table(args.table) if args.table else asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
