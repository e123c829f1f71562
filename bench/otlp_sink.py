"""A trace receiver for benchmarks: accepts OTLP/HTTP exports (``POST /v1/traces``) and drops them.

    python -m bench.otlp_sink --port 4318

``bench.floor --tracing`` points the traced proxies at it, so the proxy's own cost of tracing is measured
without a real backend's CPU on the same machine (the acceptance tests export to a real Jaeger).
"""

from __future__ import annotations

import argparse

from aiohttp import web


async def traces(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(body=b"", content_type="application/x-protobuf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/", lambda _: web.Response(text="ok"))
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
