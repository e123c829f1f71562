"""Redis: the one connection pool per process and the key naming scheme.

Owns: creating the pool from configuration, building keys, naming the Lua
scripts (``script``), and sending independent script calls of different
stages in one network round trip (``RoundTrip``). Every key is
``<prefix>:<kind>:{<tag>}:<rest>`` where ``{<tag>}`` is a Redis Cluster hash
tag, so all keys one Lua script touches live in the same slot. Must never:
hold state of its own, or let Redis exceptions escape as stack traces (stages
translate them into their own error codes).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import redis.asyncio as redis_async
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError

from .config import RedisConfig


T = TypeVar("T")

SCRIPT_NAMES: dict[str, str] = {}  # sha1 -> "<module>.<name>", for MONITOR-based tests and debugging


def script(redis: redis_async.Redis, name: str, source: str) -> AsyncScript:
    """``redis.register_script(source)``, remembered under ``name`` (e.g. ``operations.begin``)."""
    registered = redis.register_script(source)
    SCRIPT_NAMES[registered.sha] = name
    return registered


async def redis_call(command: Awaitable[T]) -> T:
    """Await one Redis command; raise ``CancelledError`` if the task was cancelled meanwhile.

    redis-py sends every command through ``asyncio.wait_for``, which on Python
    3.11 returns the inner result instead of raising when the caller is
    cancelled just as the reply arrives (CPython gh-86296): the cancel is lost
    and the task would go on (wait for a record, take a lock, send to a
    backend) for a caller that is gone. Every stage's Redis call goes through
    this. Not for cleanup (releasing a lock, undoing a reservation): that runs
    after a cancel on purpose, shielded in a task of its own, and must finish.
    """
    result = await command
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()
    return result


def create_pool(config: RedisConfig) -> redis_async.Redis:
    """A blocking pool: under a burst, a command waits (up to ``timeout_ms``) for a free connection
    instead of failing at once with "Too many connections"."""
    timeout = config.timeout_ms / 1000.0
    pool = redis_async.BlockingConnectionPool.from_url(
        config.url, max_connections=config.max_connections, timeout=timeout, socket_timeout=timeout,
        socket_connect_timeout=timeout, health_check_interval=30, decode_responses=False, **_auth_and_tls(config))
    return redis_async.Redis.from_pool(pool)


def _auth_and_tls(config: RedisConfig) -> dict[str, str]:
    """Password and TLS files from config (Secrets in Kubernetes); a URL's own password wins.

    The TLS file settings are only allowed with rediss:// URLs (checked by RedisConfig)."""
    options = {"password": config.password} if config.password else {}
    tls = {"ssl_ca_certs": config.tls_ca_file, "ssl_certfile": config.tls_cert_file,
           "ssl_keyfile": config.tls_key_file}
    return {**options, **{name: value for name, value in tls.items() if value}}


def key(prefix: str, kind: str, tag: str, *rest: str) -> str:
    """``key("toolproxy", "idem", "acme", "abc")`` -> ``toolproxy:idem:{acme}:abc``."""
    tail = ":".join(rest)
    return f"{prefix}:{kind}:{{{tag}}}" + (f":{tail}" if tail else "")


@dataclass(frozen=True)
class _Step:
    script: AsyncScript
    keys: Sequence[str]
    args: Sequence[Any]
    on_reply: Callable[[Any], None]  # gets the reply, or the RedisError/OSError that stood in for it


class RoundTrip:
    """Independent script calls (each atomic on its own slot) sent together: one network round trip.

    Stages add their step with the handler of its reply; ``send`` runs them as a non-transactional
    pipeline of EVALSHAs (a script the server lost is loaded and that step run again) and hands each
    handler its own reply or error. No step depends on another's result.
    """

    def __init__(self, redis: redis_async.Redis) -> None:
        self._redis = redis
        self._steps: list[_Step] = []

    def add(self, script: AsyncScript, keys: Sequence[str], args: Sequence[Any],
            on_reply: Callable[[Any], None]) -> None:
        self._steps.append(_Step(script, keys, args, on_reply))

    async def send(self) -> None:
        steps, self._steps = self._steps, []
        if not steps:
            return
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for step in steps:
                    pipe.evalsha(step.script.sha, len(step.keys), *step.keys, *step.args)
                replies: list[Any] = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError) as exc:
            replies = [exc] * len(steps)
        for step, reply in zip(steps, replies):
            if isinstance(reply, NoScriptError):  # the server restarted or flushed its script cache
                try:
                    reply = await step.script(keys=step.keys, args=step.args)
                except (RedisError, OSError) as exc:
                    reply = exc
            step.on_reply(reply)
