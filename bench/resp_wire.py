"""CPU per Redis script call on the write path's exchange, three ways, against one real redis-server.

A write makes three round trips of Lua scripts (EVALSHA); this bench sends batches of one EVALSHA from
``--concurrency`` tasks and reports the client process's CPU (``time.process_time``) per call for:

* ``wire``: ``proxy.wire.resp.RespWire`` as it is (hiredis's Reader parses the replies);
* ``wire_handparsed``: the same wire with the hand-written RESP2 parser it had before (read from git,
  ``--baseline`` commit), the own wire the issue compares against;
* ``redis_py``: redis-py's asyncio client (BlockingConnectionPool, hiredis parser when installed), ``evalsha``.

Usage: ``.venv/bin/python -m bench.resp_wire [--calls 20000] [--concurrency 64] [--rounds 3]``.
The interleaved rounds' medians are printed, with the ratio to ``wire``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import redis.asyncio as redis_async

from tests.support.servers import RedisServer

REPO = Path(__file__).resolve().parent.parent
SCRIPT = "redis.call('HSET', KEYS[1], 'state', ARGV[1]); return {redis.call('HGET', KEYS[1], 'state'), 1}"


def _handparsed_wire(commit: str) -> Any:
    """The module ``proxy/wire/resp.py`` at ``commit`` (the hand-parsed wire), loaded under another name."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:proxy/wire/resp.py"], check=True,
                            capture_output=True, text=True).stdout
    source = source.replace("from .connection import", "from proxy.wire.connection import")
    path = Path(tempfile.mkdtemp(prefix="resp-baseline-")) / "resp_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("resp_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _run(send: Callable[[int], Awaitable[Any]], calls: int, concurrency: int) -> float:
    """CPU seconds per call of ``calls`` sends from ``concurrency`` tasks."""
    counter = iter(range(calls))

    async def worker() -> None:
        for i in counter:
            await send(i)

    for _ in range(200):  # warm up: connections open, caches warm
        await send(0)
    start = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (time.process_time() - start) / calls


async def main(args: argparse.Namespace) -> None:
    server = RedisServer(data_dir=Path(tempfile.mkdtemp(prefix="resp-bench-")))
    server.start()
    try:
        client = redis_async.Redis.from_pool(redis_async.BlockingConnectionPool.from_url(
            server.url, max_connections=args.concurrency))
        sha = await client.script_load(SCRIPT)
        from proxy.wire.resp import RespWire
        baseline = _handparsed_wire(args.baseline)
        settings = {"host": "127.0.0.1", "port": int(server.url.rsplit(":", 1)[1].split("/")[0]),
                    "ssl_context": None, "handshake": (), "max_connections": args.concurrency, "pool_wait_s": 5.0,
                    "timeout_s": 5.0, "connect_timeout_s": 5.0}
        wires = {"wire": RespWire(**settings), "wire_handparsed": baseline.RespWire(**settings)}

        def over(wire: Any) -> Callable[[int], Awaitable[Any]]:
            async def send(i: int) -> Any:
                reply = (await wire.execute([("EVALSHA", sha, 1, f"bench:{{k}}:{i % 512}", "SUCCEEDED")]))[0]
                assert reply == [b"SUCCEEDED", 1], reply
            return send

        async def redis_py(i: int) -> Any:
            reply = await client.evalsha(sha, 1, f"bench:{{k}}:{i % 512}", "SUCCEEDED")
            assert reply == [b"SUCCEEDED", 1], reply

        cases = {"wire": over(wires["wire"]), "wire_handparsed": over(wires["wire_handparsed"]),
                 "redis_py": redis_py}
        results: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, send in cases.items():
                results[name].append(await _run(send, args.calls, args.concurrency))
        base = statistics.median(results["wire"])
        from redis.utils import HIREDIS_AVAILABLE
        print(f"redis-py parser: {'hiredis' if HIREDIS_AVAILABLE else 'python'}; calls {args.calls} x "
              f"{args.rounds} rounds, concurrency {args.concurrency}")
        for name, values in results.items():
            median = statistics.median(values)
            print(f"{name:16s} {median * 1e6:7.1f} us CPU/call  ({median / base:5.2f}x wire)  "
                  f"rounds: {', '.join(f'{v * 1e6:.1f}' for v in values)}")
        for wire in wires.values():
            await wire.close()
        await client.aclose()
    finally:
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", default="b106d8f", help="commit with the hand-parsed wire")
    args = parser.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(args))
    sys.exit(0)
