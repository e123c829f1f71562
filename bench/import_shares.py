"""Each library's share of a JSON/OpenAI-only sidecar's imports: resident memory and wall time.

What ``toolproxy run`` imports before it opens anything (``from proxy.cli import main`` and the serving path,
``proxy.fronts.app``) is listed in a fresh interpreter (``sys.modules``, in the order each import completed); then, in
further fresh interpreters, the same modules are imported group by group (the standard library the process
imports before its first library, then each library with what it brings, in ``GROUPS``' order, toolproxy's
own modules last), with the collector as ``python -m proxy.cli`` starts (``proxy/startup.py``), and the
resident memory (``VmRSS``) and wall time each group adds are measured. Medians of ``--runs`` interpreters.
The proxy's sources are byte-compiled first (as the image's are).

    .venv/bin/python -m bench.import_shares [--runs 7] [--proxy-src DIR] [--before DIR]

Wall times move with the machine's load; resident memory does not (docs/performance.md#footprint).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ENTRY = "from proxy.cli import main\nimport proxy.fronts.app\n"

# (label, top-level names): imported in this order after the standard library; a dependency a group brings
# (yarl for aiohttp, ...) counts in the first group that imports it. redis-py is imported the way the proxy
# imports it (proxy/wire/redis_py.py).
GROUPS = [
    ("uvloop, orjson, httptools", ["uvloop", "orjson", "httptools"]),
    ("PyYAML (libyaml)", ["yaml", "_yaml"]),
    ("aiohttp, client and server", ["aiohttp"]),
    ("prometheus-client", ["prometheus_client"]),
    ("redis-py (asyncio, Cluster, Sentinel; hiredis)", ["proxy.wire.redis_py", "redis", "hiredis"]),
    ("PyJWT with cryptography (the call tokens)", ["jwt", "cryptography"]),
    ("jsonschema with referencing, rpds and attrs", ["jsonschema", "referencing", "rpds", "attr", "attrs",
                                                      "jsonschema_specifications"]),
    ("jsonschema-rs", ["jsonschema_rs"]),
]

CHILD = r"""
import gc, json, sys, time, importlib
import os
if os.path.exists(os.path.join("proxy", "startup.py")):  # not a checkout from before it (an installed proxy's
    from proxy import startup                             # would be found instead)
    startup.begin()  # as python -m proxy.cli does before its imports


def rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


plan = json.loads(sys.argv[1])
out = [["the interpreter at start", rss(), 0.0]]
for label, names in plan:
    before, start = rss(), time.perf_counter()
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:  # a name only reachable through its parent's import order: its parent brings it
            pass
    if label == "toolproxy":
        exec(ENTRY)
    out.append([label, rss() - before, (time.perf_counter() - start) * 1000])
print(json.dumps(out))
"""


def imported_in_order(src: Path) -> list[str]:
    probe = ENTRY + "import json, sys\nprint(json.dumps(list(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=src, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def plan(modules: list[str]) -> list[tuple[str, list[str]]]:
    # The standard library the process imports before its first library (the interpreter's, asyncio, ssl, json,
    # argparse, ...); a standard module a library imports later counts with that library.
    third_party = {top for _, tops in GROUPS for top in tops}
    first = next(i for i, m in enumerate(modules) if m.split(".")[0] in third_party)
    stdlib = [m for m in modules[:first] if m.split(".")[0] in sys.stdlib_module_names]
    steps: list[tuple[str, list[str]]] = [("standard library (asyncio, ssl with libssl/libcrypto, json, logging, "
                                           "uuid, ...)", stdlib)]
    for label, tops in GROUPS:  # a dotted name in a group is imported first (sys.modules' order is completion's)
        steps.append((label, [t for t in tops if "." in t and t in modules] +
                      [m for m in modules if m.split(".")[0] in tops]))
    steps.append(("toolproxy", []))  # the run entry itself: toolproxy's own modules and whatever is left
    return steps


def measure(src: Path, runs: int, each: list[list]) -> None:
    """One fresh interpreter importing ``src``'s run entry group by group; its rows appended to ``each``."""
    child = f"ENTRY = {ENTRY!r}\n" + CHILD
    steps = plan(imported_in_order(src))
    out = subprocess.run([sys.executable, "-c", child, json.dumps(steps)], cwd=src, capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    each.append(json.loads(out.stdout.splitlines()[-1]))


def table(results: list[list[list]]) -> list[tuple[str, list[float], list[float]]]:
    """Per group: its label, and the median MB and ms of each tree measured."""
    rows = []
    for i, (label, _, _) in enumerate(results[0][0]):
        name = "toolproxy's own modules (and what only they import)" if label == "toolproxy" else label
        rows.append((name, [statistics.median(run[i][1] for run in tree) for tree in results],
                     [statistics.median(run[i][2] for run in tree) for tree in results]))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="fresh interpreters measured (medians)")
    parser.add_argument("--proxy-src", help="measure the proxy of this checkout")
    parser.add_argument("--before", help="also measure this checkout (the before columns), alternating with the "
                                         "other run by run so that the machine's load falls on both alike")
    args = parser.parse_args()
    trees = [Path(args.before).resolve()] if args.before else []
    trees.append(Path(args.proxy_src).resolve() if args.proxy_src else REPO)
    for tree in trees:
        compileall.compile_dir(str(tree / "proxy"), quiet=1)
    results: list[list[list]] = [[] for _ in trees]
    for _ in range(args.runs):
        for tree, each in zip(trees, results):
            measure(tree, args.runs, each)
    names = " and ".join("this checkout" if tree == REPO else str(tree) for tree in trees)
    print(f"\nProxy from {names}; medians of {args.runs} fresh interpreters each.\n")
    columns = ["before MB", "after MB", "before ms", "after ms"] if args.before else ["MB", "ms"]
    print("| what | " + " | ".join(columns) + " |\n|---|" + "---:|" * len(columns))
    totals = [[0.0] * len(trees), [0.0] * len(trees)]
    for i, (name, mbs, mss) in enumerate(table(results)):
        for t in range(len(trees)):
            totals[0][t] += mbs[t]
            totals[1][t] += mss[t]
        cells = [f"{mb:.1f}" for mb in mbs] + ["" if i == 0 else f"{ms:,.0f}" for ms in mss]
        print(f"| {name} | " + " | ".join(cells) + " |")
    cells = [f"{mb:.1f}" for mb in totals[0]] + [f"{ms:,.0f}" for ms in totals[1]]
    print("| total imported, before anything is opened | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
