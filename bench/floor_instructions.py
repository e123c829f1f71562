"""Instructions per call of the proxy process, for bench.floor's JSON-read cases: a count that a shared
machine's load does not move.

bench.floor times CPU per call; on a 2-core VM running other work a case moves ±20% round to round, more
than a 10% target can be told from. This counts instead: the same OPA, Redis, demo backend and registry as
bench.floor (its ``FLOW_TOOLS`` included), ``toolproxy run`` under ``valgrind --tool=callgrind``, and per
phase N sequential calls of one case on one keep-alive connection after a few warm ones. The counters are
zeroed and dumped at ``Pipeline.execute``'s entry (a callgrind client request, from a helper compiled here
with the system's C compiler and valgrind's header), so a phase holds exactly N calls' cycles: the call, its
answer and reading the next request. Background work (the proxy's sweeps) falls into a phase now and then;
phases alternate between the cases and the table shows each case's minimum and median over its phases.

    .venv/bin/python -m bench.floor_instructions [--calls 50] [--phases 5] [--cases flow_read,provenance_read]

Needs valgrind (with its header, Debian's ``valgrind`` package) and a C compiler. Takes about 20 s per
phase on a 2-core VM. Prints instructions per call per case and the ratios bench.floor checks on CPU
(provenance read / flow read, provenance record / flow record, each <= 1.10).
"""

from __future__ import annotations

import argparse
import ctypes
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# The cases: bench.floor's names, the tool each calls (bench.floor.FLOW_TOOLS; get_order's order_id).
CASES = {"json_read": ("JSON read", "get_order"),
         "flow_record": ("JSON read labelled (flow record)", "flow_labelled_order"),
         "flow_read": ("JSON read of an external sink (flow read)", "flow_sink_order"),
         "provenance_record": ("JSON read labelled and fingerprinted (provenance record)", "flow_source_order"),
         "provenance_read": ("JSON read of a sink naming its target (provenance read)", "flow_target_order")}
RATIOS = (("provenance_read", "flow_read", "<= 1.10"), ("provenance_record", "flow_record", "<= 1.10"),
          ("flow_read", "json_read", ""), ("flow_record", "json_read", ""))
HELPER = """#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); CALLGRIND_STOP_INSTRUMENTATION; }
"""
WARM = 5


def serve() -> int:
    """The proxy (``toolproxy run``) with ``Pipeline.execute`` counting its calls: phase p's counters run
    from the entry of call FIRST + p*(WARM+N) + WARM to the entry of call FIRST + (p+1)*(WARM+N)."""
    from proxy import startup
    startup.begin()  # as python -m proxy.cli does
    from proxy import cli, pipeline
    helper = ctypes.CDLL(os.environ["BENCH_CALLGRIND_HELPER"])
    first, calls = int(os.environ["BENCH_FIRST"]), int(os.environ["BENCH_CALLS"])
    phases = os.environ["BENCH_PHASES"].split(",")
    execute, seen = pipeline.Pipeline.execute, [0]

    async def counted(self: pipeline.Pipeline, request: object, caller: object) -> object:
        phase, at = divmod(seen[0] - first, WARM + calls)
        seen[0] += 1
        if seen[0] > first and at == WARM and phase < len(phases):
            helper.start()
        elif seen[0] > first and at == 0 and 1 <= phase <= len(phases):
            helper.dump(f"{phase - 1:03d}-{phases[phase - 1]}".encode())
        return await execute(self, request, caller)  # type: ignore[arg-type]

    pipeline.Pipeline.execute = counted  # type: ignore[method-assign]
    return cli.main(["run"])


def run(args: argparse.Namespace, workdir: Path) -> dict[str, list[float]]:
    """Start everything as bench.floor does, the proxy under callgrind; the calls; instructions per call of
    each phase by case."""
    from bench.floor import CONTRACT_ALIASES, FLOW_TOOLS, REPO, Processes, _call_token_key, setting_env, wait_http
    from tests.support.servers import OpaServer, RedisServer, free_port, mac_key_file
    helper = workdir / "callgrind_helper.so"
    (workdir / "helper.c").write_text(HELPER)
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(helper), str(workdir / "helper.c")], check=True)
    cases = args.cases.split(",")
    phases = [case for _ in range(args.phases) for case in cases]
    procs = Processes(workdir)
    try:
        opa = OpaServer([REPO / "policies", REPO / "examples" / "opa"], tcp=True)
        redis_server = RedisServer(data_dir=workdir / "redis")
        procs.servers += [opa, redis_server]
        opa.start()
        redis_server.start()
        backend_port, proxy_port, admin_port, ops_port = (free_port() for _ in range(4))
        signing_key, backend_keys = _call_token_key(workdir)
        backend = procs.spawn("backend", [sys.executable, "-m", "examples.demo_backend", "--port",
                                          str(backend_port), "--jwks-file", str(backend_keys), *CONTRACT_ALIASES])
        (workdir / "flow-tools.yaml").write_text(FLOW_TOOLS)
        (workdir / "bench-key").write_text(os.urandom(16).hex() + "\n")
        settings = {"listen.port": proxy_port, "admin.port": admin_port, "ops.port": ops_port,
                    "identity.mode": "static", **opa.settings, "redis.url": redis_server.url,
                    "backends.services": f"demo=http://127.0.0.1:{backend_port}",
                    "call_tokens.signing_key_file": str(signing_key), "integrity.mac_key_file": mac_key_file(),
                    "opa.allow_tcp": "true",
                    "registry.paths": f"{REPO / 'examples' / 'registry'},{workdir / 'flow-tools.yaml'}"}
        env = {**os.environ, "PYTHONPATH": str(REPO), **setting_env(settings),
               "TOOLPROXY_CREDENTIALS": json.dumps({"bench-key": {"kind": "bearer",
                                                                  "secret_file": str(workdir / "bench-key")}}),
               "BENCH_CALLGRIND_HELPER": str(helper), "BENCH_FIRST": str(2 * len(CASES)),
               "BENCH_CALLS": str(args.calls), "BENCH_PHASES": ",".join(phases)}
        proxy = procs.spawn("proxy", ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                      f"--callgrind-out-file={workdir}/callgrind.%p", sys.executable, "-m",
                                      "bench.floor_instructions", "--serve"], env=env)
        wait_http(f"http://127.0.0.1:{backend_port}/healthz", backend)
        wait_http(f"http://127.0.0.1:{ops_port}/readyz", proxy, bound_s=900)
        connection = http.client.HTTPConnection("127.0.0.1", proxy_port, timeout=600)
        for case in list(CASES) * 2 + [c for case in phases for c in [case] * (WARM + args.calls)] + ["json_read"]:
            _call(connection, CASES[case][1])  # every case twice first: the records the reads find are there
    finally:
        procs.stop()
    found: dict[str, list[float]] = {case: [] for case in cases}
    for dump in workdir.glob("callgrind.*"):
        text = dump.read_text(errors="replace")
        name = re.search(r"^desc: Trigger: Client Request: \d+-(\w+)", text, re.M)
        total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        if name and total and name.group(1) in found:
            found[name.group(1)].append(int(total.group(1)) / args.calls)
    return found


def _call(connection: http.client.HTTPConnection, tool: str) -> None:
    body = json.dumps({"call_id": "c1", "tool": tool, "arguments": {"order_id": "ord_1001"}})
    connection.request("POST", "/v1/tool-calls", body, {"Content-Type": "application/json"})
    answer = connection.getresponse()
    text = answer.read().decode()
    if answer.status != 200 or '"outcome":"succeeded"' not in text:
        raise RuntimeError(f"{tool}: HTTP {answer.status} {text[:400]}")


def main() -> int:
    if sys.argv[1:] == ["--serve"]:
        return serve()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=50, help="calls per phase (after 5 warm ones)")
    parser.add_argument("--phases", type=int, default=5, help="phases per case (the cases alternate)")
    parser.add_argument("--cases", default="json_read,flow_record,provenance_record,flow_read,provenance_read",
                        help=f"comma-separated, of: {', '.join(CASES)}")
    args = parser.parse_args()
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown or not shutil.which("valgrind") or not shutil.which("cc"):
        print(f"bench: unknown cases {sorted(unknown)}" if unknown else
              "bench: needs valgrind (Debian: apt-get install valgrind) and a C compiler (cc)", file=sys.stderr)
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="toolproxy-instructions-"))
    try:
        found = run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\ninstructions per call (valgrind --tool=callgrind), {args.calls} sequential calls per phase, "
          f"{args.phases} phases per case\n")
    print("| case | min | median | phases |\n|---|---:|---:|---|")
    for case, values in found.items():
        print(f"| {CASES[case][0]} | {min(values):,.0f} | {statistics.median(values):,.0f} | "
              f"{', '.join(f'{v / 1000:,.0f}K' for v in sorted(values))} |")
    print()
    for over, under, target in RATIOS:
        if found.get(over) and found.get(under):
            ratio = statistics.median(found[over]) / statistics.median(found[under])
            low = min(found[over]) / min(found[under])
            print(f"- {over.replace('_', ' ')} / {under.replace('_', ' ')} instructions: {ratio:.3f} "
                  f"(of the minima: {low:.3f}){f' (target {target})' if target else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
