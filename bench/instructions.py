"""Instructions per call of bench.floor's proxy cases, counted by callgrind: the deterministic twin of its timed table.

Starts what ``bench.floor`` starts (real OPA, Redis, demo backend, MCP upstream), but runs the proxy (and, with
``--before DIR``, the proxy of another checkout beside it) under ``valgrind --tool=callgrind`` with collection
off. For each case it then zeroes the serving process's counters, turns collection on, sends ``--calls``
sequential requests over one kept-alive connection, turns collection off and dumps: the instructions the
process ran (interpreter, C extensions, kernel entry excluded) divided by the calls. Machine load, CPU
frequency and other tenants of the VM do not move these counts, so small differences between two trees (a few
percent) show here when the timed table's noise hides them.

    .venv/bin/python -m bench.instructions [--calls 200] [--before DIR] [--only "JSON read,write replay"]

What it does not see: time spent waiting (OPA, Redis, the backend are not counted), and costs that are not
instructions (cache misses, allocation behaviour under load). The process's background work (sweeps, probes, pin
checks) runs by the clock: its rate with no call is measured first and subtracted over each measurement's time.
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable

from bench.floor import Case, Processes, start_all

CALLGRIND = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-line=no", "--compress-strings=no"]
IDLE_S = 20.0
# Under callgrind the proxy runs 50-100 times slower: its own bounds on OPA, Redis, the backends and the record
# sinks must not fire on its own slowness (the counts are of calls that succeed), and its work by the clock
# (the registry's reload, the reconciler's scan, the pinned upstreams' checks: about 1 ms of CPU a second,
# spread over hundreds of calls a second when timed) would be spread over a handful of calls: it is put off.
# The pinned case then counts what a pinned call costs between two checks.
SLOW_SETTINGS = {"opa.timeout_ms": 10000, "redis.timeout_ms": 10000, "backends.connect_timeout_ms": 10000,
                 "audit.timeout_ms": 10000, "decisions.timeout_ms": 10000, "registry.reload_interval_ms": 0,
                 "reconcile.scan_interval_ms": 3600000, "mcp_pins.check_interval_ms": 3600000,
                 "mcp_pins.max_age_ms": 3600000, "mcp_pins.read_max_age_ms": 3600000}


def control(pid: int, *flags: str) -> None:
    subprocess.run(["callgrind_control", *flags, str(pid)], check=True, capture_output=True, timeout=120)


def dumped_instructions(workdir: Path, pid: int) -> int:
    """The instruction total of the process's newest dump."""
    dumps = sorted(workdir.glob(f"callgrind.{pid}.*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
    for line in dumps[-1].read_text(errors="replace").splitlines():
        if line.startswith("totals:"):  # (a dump's "summary:" counts from the start, with collection off: 0)
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {dumps[-1]}")


class Sender:
    """One kept-alive connection sending a case's request, as the wrk script would (unique keys per call)."""

    def __init__(self, case: Case) -> None:
        host, port = case.url.split("/")[2].split(":")
        self.case, self.path = case, "/" + case.url.split("/", 3)[3]
        self.connection = http.client.HTTPConnection(host, int(port), timeout=120)

    def send(self) -> None:
        headers = {"Content-Type": "application/json",
                   **(self.case.headers() if callable(self.case.headers) else self.case.headers)}
        body = self.case.body
        if self.case.unique:
            unique = uuid.uuid4().hex
            headers["Idempotency-Key"], body = "k" + unique, body % unique
        self.connection.request("POST", self.path, body=body.encode(), headers=headers)
        answer = self.connection.getresponse()
        text = answer.read().decode(errors="replace")
        if answer.status != 200 or self.case.marker not in text:
            raise RuntimeError(f"{self.case.name}: HTTP {answer.status} {text[:300]}")


def counted(pid: int, workdir: Path, run: Callable[[], object]) -> tuple[int, float]:
    """(instructions, seconds) of the process while ``run`` runs."""
    control(pid, "--zero")
    control(pid, "--instr=on")
    started = time.monotonic()
    run()
    elapsed = time.monotonic() - started
    control(pid, "--instr=off")
    control(pid, "--dump")
    return dumped_instructions(workdir, pid), elapsed


def idle_rate(pid: int, seconds: float, workdir: Path) -> float:
    """Instructions per second the process runs with no call (its timers: sweeps, probes, pin checks)."""
    total, elapsed = counted(pid, workdir, lambda: time.sleep(seconds))
    return total / elapsed


def count(case: Case, calls: int, workdir: Path, idle: float) -> float:
    """Instructions per call of ``calls`` requests of ``case`` (after a few uncounted ones), less the process's
    idle rate over the same time."""
    pid = case.pid()
    assert pid is not None
    sender = Sender(case)
    for _ in range(5):
        sender.send()
    total, elapsed = counted(pid, workdir, lambda: [sender.send() for _ in range(calls)])
    sender.connection.close()
    return max(0.0, total - idle * elapsed) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--before", metavar="DIR", help="also count a proxy run from this checkout")
    parser.add_argument("--only", help="comma-separated case names (default: every proxy case)")
    parser.add_argument("--keep", action="store_true", help="keep the dumps (one per measurement, in the order "
                        "of the table, the idle windows first) for callgrind_annotate; their directory is printed")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("wrk") is None:
        print("bench: valgrind and wrk are needed: run scripts/setup.sh", file=sys.stderr)
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="toolproxy-instructions-"))
    args.proxy_src, args.tracing, args.contextforge = None, False, False
    args.wrap = [*CALLGRIND, f"--callgrind-out-file={workdir}/callgrind.%p"]
    args.slow_settings, args.ready_s = SLOW_SETTINGS, 600.0
    procs = Processes(workdir)
    try:
        _, cases = start_all(args, procs, workdir)
        proxy = next(c for c in cases if c.name == "JSON read")
        wanted = set(args.only.split(",")) if args.only else None
        mine = [c for c in cases if c.pid() == proxy.pid() and (wanted is None or c.name in wanted)]
        print(f"{args.calls} sequential calls per case, counted by callgrind; proxy from this checkout"
              f"{f', [before] from {args.before}' if args.before else ''}.\n")
        idle = {pid: idle_rate(pid, IDLE_S, workdir) for pid in {proxy.pid(), *(
            [proxy.before.pid()] if proxy.before is not None else [])}}
        print("| case | instructions/call | before | after / before |\n|---|---:|---:|---:|")
        for case in mine:
            after = count(case, args.calls, workdir, idle[case.pid()])
            before = count(case.before, args.calls, workdir, idle[case.before.pid()]) if case.before else None
            ratio = f"{after / before:.3f}" if before else "–"
            print(f"| {case.name} | {after:,.0f} | {f'{before:,.0f}' if before else '–'} | {ratio} |", flush=True)
        print(f"\nidle instructions/s (subtracted over each measurement's time): "
              + "; ".join(f"{'[before] ' if proxy.before and pid == proxy.before.pid() else ''}{rate:,.0f}"
                          for pid, rate in idle.items()))
        return 0
    finally:
        procs.stop()
        if args.keep:
            print(f"dumps: {workdir}/callgrind.<pid>.<n>")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
