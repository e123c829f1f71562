"""Real OPA (repo policies + demo data) and Redis for benchmarks, like the test fixtures."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Iterator

from tests.support.servers import OpaServer, RedisServer

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def real_dependencies() -> Iterator[dict[str, str]]:
    """Config overrides pointing an in-process proxy at a fresh OPA and Redis."""
    opa = OpaServer([REPO / "policies", REPO / "examples" / "opa"])
    redis = RedisServer(data_dir=Path(tempfile.mkdtemp(prefix="toolproxy-bench-")))
    opa.start()
    redis.start()
    try:
        yield {**opa.settings, "redis.url": redis.url}
    finally:
        redis.stop()
        opa.stop()
