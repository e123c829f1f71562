"""Each library's share of a JSON/OpenAI-only sidecar's imports: resident memory and wall time.

What ``toolproxy run`` imports before it opens anything (``from proxy.cli import main`` and the serving path,
``proxy.fronts.app``) is listed in a fresh interpreter (``sys.modules``, in the order each import completed); then, in
further fresh interpreters, the same modules are imported group by group (the standard library the process
imports before its first library, then each library with what it brings, in ``GROUPS``' order, toolproxy's
own modules last), with the collector as ``python -m proxy.cli`` starts (``proxy/startup.py``), and the
resident memory (``VmRSS``) and wall time each group adds are measured. Medians of ``--runs`` interpreters.
The proxy's sources are byte-compiled first (as the image's are).

    .venv/bin/python -m bench.import_shares [--runs 7] [--proxy-src DIR]

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
try:
    from proxy import startup
    startup.begin()  # as python -m proxy.cli does before its imports
except ImportError:  # a checkout from before proxy/startup.py
    pass


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
        steps.append((label, [t for t in tops if "." in t] + [m for m in modules if m.split(".")[0] in tops]))
    steps.append(("toolproxy", []))  # the run entry itself: toolproxy's own modules and whatever is left
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="fresh interpreters measured (medians)")
    parser.add_argument("--proxy-src", help="measure the proxy of this checkout")
    args = parser.parse_args()
    src = Path(args.proxy_src).resolve() if args.proxy_src else REPO
    compileall.compile_dir(str(src / "proxy"), quiet=1)
    steps = plan(imported_in_order(src))
    child = f"ENTRY = {ENTRY!r}\n" + CHILD
    runs = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", child, json.dumps(steps)], cwd=src, capture_output=True,
                             text=True, check=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        runs.append(json.loads(out.stdout.splitlines()[-1]))
    print(f"\nProxy from {'this checkout' if src == REPO else src}; medians of {args.runs} fresh interpreters.\n")
    print("| what | MB | ms |\n|---|---:|---:|")
    total_mb = total_ms = 0.0
    for i, (label, _, _) in enumerate(runs[0]):
        mb = statistics.median(run[i][1] for run in runs)
        ms = statistics.median(run[i][2] for run in runs)
        total_mb += mb
        total_ms += ms
        name = "toolproxy's own modules (and what only they import)" if label == "toolproxy" else label
        print(f"| {name} | {mb:.1f} | {'' if i == 0 else f'{ms:,.0f}'} |")
    print(f"| total imported, before anything is opened | {total_mb:.1f} | {total_ms:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
