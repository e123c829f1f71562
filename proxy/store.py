"""Redis: the one client per process, the key naming scheme, and replicated writes.

Owns: creating the process's one Redis client for the configured mode
(``standalone``: a blocking pool on ``redis.url``, whose Lua scripts and
``RoundTrip`` batches go over the hot path's ``RespWire`` to the same server,
proxy/wire/resp.py; ``sentinel``: redis-py's
Sentinel client, which asks the Sentinels for the current master and follows a
failover; ``cluster``: redis-py's RedisCluster, which routes each command to
the master of its key's slot), building keys, the registry of Lua scripts
(``lua`` declares one, ``script`` runs it), checking that every Lua script's keys share one Cluster slot,
running a script and ``WAIT`` for replica acknowledgement on one connection,
sending independent script calls of different stages in one network round
trip (``RoundTrip``, with their ``WAIT`` in the same pipeline), the
readiness probe of the masters and reading each master's ``INFO``. Every key is ``<prefix>:<kind>:{<tag>}:<rest>``
where ``{<tag>}`` is a Redis Cluster hash tag, so all keys one Lua script
touches live in the same slot; and the vocabulary a stage answers a store fault in (fail closed, degrade,
count and go on, keep as a value: ``unavailable_on_fault`` and its siblings). Must never: hold state of its
own beyond the script registry, or let Redis exceptions escape as stack traces (stages answer them with one
of the named policies, in their own error codes).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence, TypeVar, Union

from .wire import redis_py  # noqa: F401  # first: redis-py imported without OpenTelemetry's metrics SDK

import redis.asyncio as redis_async
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.commands.core import AsyncScript
from redis.crc import key_slot
from redis.maint_notifications import MaintNotificationsConfig
from redis.exceptions import (ConnectionError as RedisConnectionError, MaxConnectionsError, NoScriptError,
                              RedisClusterException, RedisError, ResponseError)

from .config import ConfigError, RedisConfig
from .errors import ProxyError
from .wire.resp import RespWire

Client = Union[redis_async.Redis, RedisCluster]
T = TypeVar("T")

SCRIPT_NAMES: dict[str, str] = {}  # sha1 -> "<module>.<name>", for MONITOR-based tests and debugging


# What redis-py raises from inside its own client when a connection's (re)connect races a failover's
# disconnect of the same connection (redis-py 8): its writer gone (AttributeError), uvloop's closed handle
# (RuntimeError), a slot table being rebuilt (KeyError), a half-torn connection (TypeError). Raised inside
# the client, that is the store failing, not the proxy.
CLIENT_FAULTS = (AttributeError, RuntimeError, KeyError, TypeError)


def client_faults_as_unavailable(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Wrap one of redis-py's entry points so that ``CLIENT_FAULTS`` raised under it arrive as
    ``StoreUnavailable`` (handled like a dropped connection). Only redis-py's code runs under these entry
    points, so no fault of the proxy's own is taken for the store's."""
    @functools.wraps(method)
    async def call(*args: Any, **kwargs: Any) -> T:
        try:
            return await method(*args, **kwargs)
        except CLIENT_FAULTS as exc:
            raise StoreUnavailable(f"redis client fault ({type(exc).__name__})") from None
    return call


class _ClientFaults:
    """For redis-py's client classes: commands, pipelines and pub/sub reads go through
    ``client_faults_as_unavailable`` (the boundary between the client and the proxy)."""

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        try:
            return await super().execute_command(*args, **options)  # type: ignore[misc]
        except CLIENT_FAULTS as exc:
            raise StoreUnavailable(f"redis client fault ({type(exc).__name__})") from None

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = super().pipeline(*args, **kwargs)  # type: ignore[misc]
        pipe.execute = client_faults_as_unavailable(pipe.execute)
        return pipe

    def pubsub(self, **kwargs: Any) -> Any:
        pubsub = super().pubsub(**kwargs)  # type: ignore[misc]
        for name in ("subscribe", "unsubscribe", "get_message"):
            setattr(pubsub, name, client_faults_as_unavailable(getattr(pubsub, name)))
        return pubsub


class _Redis(_ClientFaults, redis_async.Redis):
    """redis-py's client with the fault boundary (Sentinel's master)."""


class WiredRedis(_ClientFaults, redis_async.Redis):
    """The standalone client: redis-py's, plus the hot path's ``RespWire`` to the same server, which its
    scripts (``register_script``) and ``RoundTrip`` batches go over. Everything else is redis-py's."""

    wire: RespWire | None = None

    def register_script(self, script: Any) -> AsyncScript:
        return _WiredScript(self, script)


class _WiredScript(AsyncScript):
    """redis-py's ``AsyncScript`` (EVALSHA; on NOSCRIPT, load it and run it once more) over the wire."""

    async def __call__(self, keys: Sequence[Any] | None = None, args: Sequence[Any] | None = None,
                       client: Any = None) -> Any:
        wire = self.registered_client.wire
        if wire is None or client is not None:
            return await super().__call__(keys, args, client)
        keys, args = keys or (), args or ()
        reply = (await wire.execute([_evalsha(self, keys, args)]))[0]
        if isinstance(reply, NoScriptError):
            loaded = (await wire.execute([("SCRIPT", "LOAD", self.script)]))[0]
            if isinstance(loaded, Exception):
                raise loaded
            self.sha = loaded.decode()
            reply = (await wire.execute([_evalsha(self, keys, args)]))[0]
        if isinstance(reply, Exception):
            raise reply
        return reply


# -- Lua scripts: declared once, in one registry --------------------------------

@dataclass(frozen=True)
class Lua:
    """A Lua script the proxy runs: its name (``<module>.<name>``, e.g. ``locks.acquire``) and its source.
    Made only by ``lua``, which keeps it in ``LUA_SCRIPTS``; run through ``script``."""

    name: str
    source: str

    @property
    def sha(self) -> str:
        """The SHA1 EVALSHA names it by (what ``SCRIPT LOAD`` answers)."""
        return hashlib.sha1(self.source.encode()).hexdigest()


LUA_SCRIPTS: dict[str, Lua] = {}  # name -> script: every Lua script of the proxy, declared at import


def lua(name: str, source: str) -> Lua:
    """Declare the Lua script ``name`` (a module-level constant of the stage that runs it). The one way a
    script enters the proxy: tests/unit/test_lua_registry.py fails on Lua source declared otherwise."""
    declared = LUA_SCRIPTS.get(name)
    if declared is not None and declared.source != source:
        raise ValueError(f"Lua script {name} is declared twice with different sources")
    declared = LUA_SCRIPTS[name] = Lua(name, source)
    SCRIPT_NAMES[declared.sha] = name
    return declared


def script(redis: Client, declared: Lua) -> AsyncScript:
    """A declared script on ``redis``: EVALSHA; on NOSCRIPT (a fresh server, a flushed cache, a new master)
    it is loaded and run once more (redis-py's ``AsyncScript``; standalone: over the wire,
    ``_WiredScript``). Nothing is sent until it first runs."""
    return redis.register_script(declared.source)


@dataclass(frozen=True)
class Then:
    """A script call to make right after another one, in the same script call, if the first's reply allows
    (``chained``): its script, keys and arguments."""

    script: AsyncScript
    keys: Sequence[str]
    args: Sequence[Any]

    def joined(self, keys: Sequence[str], args: Sequence[Any]) -> tuple[list[str], list[Any]]:
        """The keys and arguments of a ``chained`` script: the first call's (``keys``, ``args``), then these."""
        return [*keys, *self.keys], [len(keys), len(args), *args, *self.args]


# ``first`` and ``second`` are the two scripts' own sources, each wrapped as a function of its KEYS and ARGV
# (the parameters shadow the globals); ARGV[1] and ARGV[2] say how many keys and arguments are the first's.
_CHAIN = """
local function first(KEYS, ARGV)
%(first)s
end
local function second(KEYS, ARGV)
%(second)s
end
local nk, na = tonumber(ARGV[1]), tonumber(ARGV[2])
local k1, a1, k2, a2 = {}, {}, {}, {}
for i = 1, #KEYS do
  if i <= nk then k1[#k1 + 1] = KEYS[i] else k2[#k2 + 1] = KEYS[i] end
end
for i = 3, #ARGV do
  if i - 2 <= na then a1[#a1 + 1] = ARGV[i] else a2[#a2 + 1] = ARGV[i] end
end
local r = first(k1, a1)
if not (%(proceed_if)s) then return {r} end
return {r, second(k2, a2)}
"""

def chained(redis: Client, first: AsyncScript, then: Then, *, proceed_if: str) -> AsyncScript | None:
    """One script that runs ``first`` and then, if the Lua expression ``proceed_if`` holds for its reply
    ``r``, ``then``'s script: one round trip instead of two, and nothing between them. Its reply is
    ``[first's]`` or ``[first's, then's]``; call it with ``then.joined(keys, args)``. None for a
    Cluster client: the two scripts' keys live in different slots, which only a single server holds
    together (standalone, or Sentinel's master). Callers keep what it returns (one per pair)."""
    if isinstance(redis, RedisCluster):
        return None
    source = _CHAIN % {"first": first.script, "second": then.script.script, "proceed_if": proceed_if}
    return script(redis, lua(f"{SCRIPT_NAMES.get(first.sha, 'first')}+{SCRIPT_NAMES.get(then.script.sha, 'then')}",
                             source))


class StoreUnavailable(RedisConnectionError):
    """RedisCluster's own "cannot reach the cluster / no node for this slot" (not a RedisError in redis-py),
    as the RedisError every stage already handles."""


# The one vocabulary for a failed state-store call: whatever a call through ``redis_call`` /
# ``translated`` raises when the store is away is a ``StoreError`` (redis-py's ``RedisError``; RedisCluster's
# own exceptions and a bare socket error arrive as ``StoreUnavailable``). A stage answers it with one of the
# named policies below (failing closed answers ``unavailable(...)``).
StoreError = RedisError
DEPENDENCY = "state_store"  # ``details.dependency`` of every envelope about the store (Redis, Valkey, ...)


def unavailable(message: str, *, phase: str, attempted: bool = False, committed: bool | None = False,
                **details: Any) -> ProxyError:
    """The error envelope of a stage whose store call failed: ``dependency_unavailable`` with
    ``details.dependency: state_store`` (plus the stage's own details), nothing applied by default."""
    return ProxyError("dependency_unavailable", message, details={"dependency": DEPENDENCY, **details},
                      phase=phase, attempted=attempted, committed=committed)


# -- store faults: a call site names its policy ---------------------------------
#
# A store fault reaches a stage as a ``StoreError`` (above); the stage answers it with one of these named
# policies rather than an ``except`` clause of its own:
#   fail closed      ``with unavailable_on_fault(message, phase=...)``: the call is answered
#                    ``dependency_unavailable`` (nothing applied);
#   degrade          ``await degrade_on_fault(command, fallback)``: the command's answer, or ``fallback(fault)``
#                    (a default, a read that proceeds, a refusal of its own);
#   count and go on  ``with logged_on_fault(log, message, count=...)``: logged (and counted), the caller goes
#                    on without the command's effect (a lease, a TTL or the next pass makes up for it);
#   keep as a value  ``await fault_as_value(command)``: the answer, or the fault itself (a sweep that
#                    reports a failed part and goes on with the others).
# The few ``except`` clauses left on store faults (tests/unit/test_store_fault_policies.py counts them) each
# say their policy on a ``# policy:`` line.

# A store fault, or a socket error or time bound around a store call not made through ``redis_call`` (a
# shielded cleanup, a probe under ``asyncio.timeout``; ``TimeoutError`` is an ``OSError``).
STORE_OR_SOCKET_FAULTS: tuple[type[Exception], ...] = (StoreError, OSError)

D = TypeVar("D")


def unavailable_on_fault(message: str, *, phase: str, **details: Any) -> "_FailClosed":
    """Fail closed: a ``StoreError`` raised in the block is re-raised as ``unavailable(message, phase=...)``
    (``dependency_unavailable``, nothing applied)."""
    return _FailClosed(message, phase, details)


class _FailClosed:
    """``unavailable_on_fault``'s block. This and ``_LoggedOnFault`` are classes rather than ``contextlib``
    generators: a call's every stage enters them (no generator, no ``StopIteration`` per block)."""

    __slots__ = ("_message", "_phase", "_details")

    def __init__(self, message: str, phase: str, details: dict[str, Any]) -> None:
        self._message, self._phase, self._details = message, phase, details

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, fault: BaseException | None, tb: Any) -> bool:
        if kind is not None and issubclass(kind, StoreError):
            raise unavailable(self._message, phase=self._phase, **self._details) from None
        return False


async def degrade_on_fault(command: Awaitable[T], fallback: Callable[[Exception], D], *,
                           faults: tuple[type[Exception], ...] = (StoreError,)) -> T | D:
    """Degrade: ``command``'s answer, or ``fallback(fault)`` when it fails with one of ``faults`` (a default
    such as ``lambda _: False``, or the stage's own answer for the store being away, which may raise)."""
    try:
        return await command
    except faults as fault:
        return fallback(fault)


def logged_on_fault(log: logging.Logger, message: str, *args: Any, count: Callable[[], object] | None = None,
                    level: int = logging.WARNING,
                    faults: tuple[type[Exception], ...] = (StoreError,)) -> "_LoggedOnFault":
    """Count and go on: one of ``faults`` raised in the block ends the block; ``count()`` runs (a metric's
    ``inc``), ``message % args`` is logged at ``level`` with the fault's class (never its text: it may name a
    host), and the caller goes on after the block."""
    return _LoggedOnFault(log, message, args, count, level, faults)


class _LoggedOnFault:
    """``logged_on_fault``'s block (a class: see ``_FailClosed``)."""

    __slots__ = ("_log", "_message", "_args", "_count", "_level", "_faults")

    def __init__(self, log: logging.Logger, message: str, args: tuple[Any, ...], count: Callable[[], object] | None,
                 level: int, faults: tuple[type[Exception], ...]) -> None:
        self._log, self._message, self._args, self._count = log, message, args, count
        self._level, self._faults = level, faults

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, fault: BaseException | None, tb: Any) -> bool:
        if kind is None or not issubclass(kind, self._faults):
            return False
        if self._count is not None:
            self._count()
        self._log.log(self._level, self._message + " (%s)", *self._args, kind.__name__)
        return True


async def fault_as_value(command: Awaitable[T]) -> T | StoreError:
    """Keep as a value: ``command``'s answer, or the ``StoreError`` it failed with, returned (not raised)."""
    try:
        return await command
    except StoreError as fault:
        return fault


async def redis_call(command: Awaitable[T]) -> T:
    """Await one Redis command; raise ``CancelledError`` if the task was cancelled meanwhile.

    redis-py sends every command through ``asyncio.wait_for``, which on Python
    3.11 returns the inner result instead of raising when the caller is
    cancelled just as the reply arrives (CPython gh-86296): the cancel is lost
    and the task would go on (wait for a record, take a lock, send to a
    backend) for a caller that is gone. Every stage's Redis call goes through
    this. Only cleanup (releasing a lock, undoing a reservation) uses ``translated`` alone: it runs
    after a cancel on purpose, shielded in a task of its own, and must finish.
    """
    result = await translated(command)
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()
    return result


class _BlockingCluster(_ClientFaults, RedisCluster):
    """RedisCluster whose per-node pools wait (up to ``pool_wait_s``) for a free connection, as the other modes'
    blocking pools do, instead of failing at once. Safe to repeat: the pool refuses before anything is sent."""

    pool_wait_s = 0.5

    async def _execute_command(self, target_node: ClusterNode, *args: Any, **kwargs: Any) -> Any:
        return await _pool_waiting(lambda: super(_BlockingCluster, self)._execute_command(target_node, *args,
                                                                                          **kwargs),
                                   self.pool_wait_s)


async def _pool_waiting(command: Callable[[], Awaitable[T]], wait_s: float) -> T:
    loop = asyncio.get_running_loop()
    until, pause = loop.time() + wait_s, 0.001
    while True:
        try:
            return await command()
        except MaxConnectionsError:
            if loop.time() >= until:
                raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05)


class _BlockingSentinelPool(SentinelConnectionPool, redis_async.BlockingConnectionPool):
    """Sentinel's master discovery with the blocking pool's wait for a free connection (as standalone)."""


async def translated(command: Awaitable[T]) -> T:
    """Await one Redis command, RedisCluster's ``RedisClusterException`` (no reachable node, slot not
    covered; not a ``RedisError`` in redis-py) and a socket error redis-py let through raised as
    ``StoreUnavailable``, a ``StoreError``. (A fault inside the client during a failover already arrives as
    one: ``_ClientFaults``.)"""
    try:
        return await command
    except RedisError:
        raise
    except (RedisClusterException, OSError) as exc:
        raise StoreUnavailable(type(exc).__name__) from None


def create_client(config: RedisConfig) -> Client:
    """The process's one Redis client. Under a burst a command waits (up to ``timeout_ms``) for a free
    connection instead of failing at once with "Too many connections" (cluster: per node)."""
    timeout = config.timeout_ms / 1000.0
    # No maintenance notifications (a Redis Enterprise/Cloud feature, "auto" under RESP3 in redis-py 8): they
    # cost a handshake per connection, and their connect path raced a failover's disconnect into an
    # AttributeError inside redis-py instead of a ConnectionError.
    common: dict[str, Any] = {"socket_timeout": timeout, "socket_connect_timeout": timeout,
                              "decode_responses": False,
                              "maint_notifications_config": MaintNotificationsConfig(enabled=False),
                              **_auth_and_tls(config)}
    if config.mode == "cluster":
        nodes = [ClusterNode(host, port) for host, port in addresses(config.cluster_nodes)]
        cluster = _BlockingCluster(startup_nodes=nodes, max_connections=config.max_connections, **common)
        cluster.pool_wait_s = timeout
        return cluster
    if config.mode == "sentinel":
        sentinel_auth = {"password": config.sentinel_password} if config.sentinel_password else {}
        tls = {name: value for name, value in _auth_and_tls(config).items() if name.startswith("ssl")}
        # No retries per Sentinel (redis-py's default backs off for seconds): the next Sentinel is the retry.
        sentinel = Sentinel(addresses(config.sentinels), sentinel_kwargs={
            "socket_timeout": timeout, "socket_connect_timeout": timeout, "retry": Retry(NoBackoff(), 0),
            **sentinel_auth, **tls}, **common)
        return sentinel.master_for(config.sentinel_service, redis_class=_Redis,
                                   connection_pool_class=_BlockingSentinelPool,
                                   max_connections=config.max_connections, timeout=timeout,
                                   health_check_interval=30)
    pool = redis_async.BlockingConnectionPool.from_url(
        config.url, max_connections=config.max_connections, timeout=timeout, health_check_interval=30, **common)
    client = WiredRedis.from_pool(pool)
    client.wire = RespWire.for_client(client)
    return client


async def close_client(client: Client) -> None:
    wire = getattr(client, "wire", None)
    if wire is not None:
        await wire.close()
    await client.aclose()
    pool = getattr(client, "connection_pool", None)
    if isinstance(pool, SentinelConnectionPool):
        await pool.sentinel_manager.aclose()


def addresses(specs: Sequence[str]) -> list[tuple[str, int]]:
    """``["h:6379", "[::1]:7000"]`` -> ``[("h", 6379), ("::1", 7000)]`` (checked by RedisConfig)."""
    out = []
    for spec in specs:
        host, _, port = spec.rpartition(":")
        out.append((host.strip("[]"), int(port)))
    return out


def _auth_and_tls(config: RedisConfig) -> dict[str, Any]:
    """Password and TLS files from config (Secrets in Kubernetes); a URL's own password wins.

    Standalone takes TLS from its rediss:// URL; sentinel and cluster from ``redis.tls``."""
    options: dict[str, Any] = {"password": config.password} if config.password else {}
    if config.username:
        options["username"] = config.username
    if config.mode != "standalone" and config.tls:
        options["ssl"] = True
    if config.uses_tls:  # explicit: redis-py's default changed across versions
        options["ssl_check_hostname"] = config.tls_check_hostname
    tls = {"ssl_ca_certs": config.tls_ca_file, "ssl_certfile": config.tls_cert_file,
           "ssl_keyfile": config.tls_key_file}
    return {**options, **{name: value for name, value in tls.items() if value}}


async def masters_reachable(client: Client) -> bool:
    """One PING per master: the standalone server, Sentinel's current master, or every Cluster master
    (a slot range whose master is down and not yet replaced makes the proxy not ready)."""
    if isinstance(client, RedisCluster):
        return bool(await redis_call(client.ping(target_nodes=RedisCluster.PRIMARIES)))
    return bool(await redis_call(client.ping()))


async def masters_info(client: Client, section: str) -> list[tuple[str, Mapping[str, Any] | None]]:
    """``INFO <section>`` of every master, as (its name, the parsed fields, or None if it refuses INFO:
    a managed service that renamed or disabled it): the standalone server (``host:port``), Sentinel's
    current master (``sentinel:<service>``) or each Cluster master (``host:port``). INFO, not CONFIG GET:
    managed Redis services often disable CONFIG. An unreachable master raises ``StoreError``."""
    if isinstance(client, RedisCluster):
        await redis_call(client.initialize())
        nodes = client.get_primaries()
        answers = await asyncio.gather(*(_info_or_none(client.info(section, target_nodes=node)) for node in nodes))
        return [(node.name, answer) for node, answer in zip(nodes, answers)]
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        name = f"sentinel:{pool.service_name}"
    else:
        name = f"{pool.connection_kwargs.get('host', '?')}:{pool.connection_kwargs.get('port', '?')}"
    return [(name, await _info_or_none(client.info(section)))]


async def _info_or_none(command: Awaitable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    try:
        return await redis_call(command)
    except ResponseError:
        return None


async def run_replicated(client: Client, script: AsyncScript, keys: Sequence[str], args: Sequence[Any], *,
                         acks: int, timeout_ms: int) -> tuple[Any, int]:
    """Run a script, then ``WAIT acks timeout_ms`` on the same connection; (reply, replicas that acknowledged).

    ``WAIT`` counts the replicas that have every write *this connection* made, so both go in one
    pipeline to the master of the keys' slot. With ``acks`` 0 the script runs alone (reply, 0)."""
    if acks <= 0:
        return await redis_call(script(keys=keys, args=args)), 0
    wait_s = getattr(client, "pool_wait_s", 0.0)
    for attempt in (1, 2):
        reply, acked = await redis_call(_pool_waiting(
            lambda: _send_scripts(client, [(script, keys, args, acks, timeout_ms)]), wait_s))
        if isinstance(reply, NoScriptError) and attempt == 1:  # a new master (failover) without the script
            script.sha = await redis_call(client.script_load(script.script))
            continue
        break
    for result in (reply, acked):
        if isinstance(result, Exception):
            raise result
    return reply, int(acked)


# (script, keys, args, acks, WAIT timeout ms): one script call, followed by ``WAIT`` when acks > 0
ScriptCall = tuple[AsyncScript, Sequence[str], Sequence[Any], int, int]


def _evalsha(script: AsyncScript, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, ...]:
    return ("EVALSHA", script.sha, len(keys), *keys, *args)


def _commands(call: ScriptCall) -> list[tuple[Any, ...]]:
    script, keys, args, acks, timeout_ms = call
    return [_evalsha(script, keys, args)] + ([("WAIT", acks, timeout_ms)] if acks > 0 else [])


async def _send_scripts(client: Client, calls: Sequence[ScriptCall]) -> list[Any]:
    """Script calls in one round trip, each reply (or error) in order: the wire's batch (standalone), else
    a non-transactional pipeline (cluster: each call and its WAIT to the master of its keys' slot; redis-py
    blocks ``pipe.evalsha`` there, so the node is named)."""
    wire = getattr(client, "wire", None)
    if wire is not None:
        return await wire.execute([command for call in calls for command in _commands(call)])
    cluster = isinstance(client, RedisCluster)
    if cluster:
        await client.initialize()
    async with client.pipeline(transaction=False) as pipe:
        for call in calls:
            target = {"target_nodes": client.get_node_from_key(call[1][0])} if cluster else {}
            for command in _commands(call):
                pipe.execute_command(*command, **target)
        return list(await pipe.execute(raise_on_error=False))


def check_one_slot(key_sets: Mapping[str, Sequence[Sequence[str]]]) -> None:
    """Every key set (the keys one script call touches) must hash to one Cluster slot; raise naming the first
    that does not. Run at start-up on key sets built by the stores' own key builders."""
    for script, sets in key_sets.items():
        for keys in sets:
            slots = sorted({key_slot(k.encode()) for k in keys})
            if len(slots) > 1:
                raise ConfigError(f"redis: the keys of script {script} span Cluster slots {slots} "
                                  f"({', '.join(keys)}); check redis.key_prefix (no braces)")


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
    acks: int = 0  # > 0: a replicated write, followed by WAIT acks timeout_ms on its connection
    timeout_ms: int = 0
    on_acked: Callable[[int], None] | None = None  # replicas that acknowledged (not called on an error)


class RoundTrip:
    """Independent script calls (each atomic on its own slot) sent together: one network round trip.

    Stages add their step with the handler of its reply; ``send`` runs them as a non-transactional
    pipeline of EVALSHAs (a script the server lost is loaded and that step run again) and hands each
    handler its own reply or error. No step depends on another's result. A replicated step (``acks`` > 0)
    is followed in the same pipeline by ``WAIT acks timeout_ms`` on the connection to its slot's master
    (cluster: the pipeline splits by node and keeps each node's order), so the write and its
    acknowledgement still cost one round trip.
    """

    def __init__(self, redis: Client) -> None:
        self._redis = redis
        self._steps: list[_Step] = []

    def add(self, script: AsyncScript, keys: Sequence[str], args: Sequence[Any],
            on_reply: Callable[[Any], None], *, acks: int = 0, timeout_ms: int = 0,
            on_acked: Callable[[int], None] | None = None) -> None:
        self._steps.append(_Step(script, keys, args, on_reply, acks, timeout_ms, on_acked))

    def __bool__(self) -> bool:
        """Whether any step waits to be sent (a read without a record or lock has none)."""
        return bool(self._steps)

    async def send(self) -> None:
        steps, self._steps = self._steps, []
        if not steps:
            return
        try:
            replies = await translated(_pool_waiting(lambda: self._pipeline(steps),
                                                     getattr(self._redis, "pool_wait_s", 0.0)))
        except (RedisError, OSError) as exc:
            replies = [exc] * sum(2 if step.acks > 0 else 1 for step in steps)
        answers = await self._reload_lost_scripts(steps, self._answers(steps, replies))
        for step, (reply, acked) in zip(steps, answers):
            if isinstance(reply, NoScriptError):  # the server restarted, flushed its script cache, failed over
                reply, acked = await self._alone(step)
            step.on_reply(reply)
            if step.on_acked is not None and not isinstance(reply, BaseException) \
                    and not isinstance(acked, BaseException) and acked is not None:
                step.on_acked(int(acked))

    async def _reload_lost_scripts(self, steps: Sequence[_Step],
                                   answers: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
        """A fresh server, a flushed cache or a new master: load each lost script once, resend those steps in
        one batch. What still fails is retried step by step (``_alone``)."""
        lost = [i for i, (reply, _) in enumerate(answers) if isinstance(reply, NoScriptError)]
        if not lost:
            return answers
        try:
            for source in {steps[i].script.sha: steps[i].script for i in lost}.values():
                await translated(self._redis.script_load(source.script))
            again = [steps[i] for i in lost]
            for i, answer in zip(lost, self._answers(again, await translated(self._pipeline(again)))):
                answers[i] = answer
        except (RedisError, OSError):
            pass  # each step is retried on its own
        return answers

    async def _alone(self, step: _Step) -> tuple[Any, Any]:
        try:
            if step.acks > 0:
                return await run_replicated(self._redis, step.script, step.keys, step.args,
                                            acks=step.acks, timeout_ms=step.timeout_ms)
            return await translated(step.script(keys=step.keys, args=step.args)), None
        except (RedisError, OSError) as exc:
            return exc, None

    @staticmethod
    def _answers(steps: Sequence[_Step], replies: Sequence[Any]) -> list[tuple[Any, Any]]:
        """(reply, WAIT reply or None) per step, from the pipeline's flat reply list."""
        answers, at = [], 0
        for step in steps:
            answers.append((replies[at], replies[at + 1] if step.acks > 0 else None))
            at += 2 if step.acks > 0 else 1
        return answers

    async def _pipeline(self, steps: Sequence[_Step]) -> list[Any]:
        return await _send_scripts(self._redis, [(step.script, step.keys, step.args, step.acks, step.timeout_ms)
                                                 for step in steps])


# -- pub/sub listeners ---------------------------------------------------------

class ChannelListener:
    """One pub/sub channel listened to for ever in a task of its own: ``on_subscribed`` after each
    (re)subscription (load a snapshot, say "ready"), ``on_message`` for each message; a lost connection is
    retried with backoff (logged once per loss as ``<what> lost``). ``start`` once, ``stop`` at shutdown."""

    def __init__(self, redis: Any, channel: str, on_message: Callable[[Any], None], *,
                 on_subscribed: Callable[[], Awaitable[None]], what: str, log: Any) -> None:
        self._redis, self._channel, self._on_message = redis, channel, on_message
        self._on_subscribed, self._what, self._log = on_subscribed, what, log
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._listen(), name=f"toolproxy {self._what}")

    async def stop(self) -> None:
        """Cancel until it ends: redis-py can swallow one cancel (CPython gh-86296, see ``redis_call``)."""
        task, self._task = self._task, None
        while task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.5)

    async def _listen(self) -> None:
        backoff, lost = 0.1, False
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await translated(pubsub.subscribe(self._channel))
                await self._on_subscribed()
                if lost:
                    self._log.info("%s back", self._what)
                backoff, lost = 0.1, False
                while True:
                    message = await translated(pubsub.get_message(timeout=5.0))
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():  # a cancel redis-py swallowed (gh-86296)
                        raise asyncio.CancelledError()
                    if message is not None and message.get("type") == "message":
                        self._on_message(message["data"])
            except (StoreError, OSError) as exc:  # policy: retry with backoff: the listener must come back
                if not lost:  # once per loss: an unreachable Redis is one line, not one per retry
                    self._log.warning("%s lost (%s); retrying with backoff until Redis answers", self._what,
                                      type(exc).__name__)
                lost = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                try:
                    await asyncio.shield(pubsub.aclose())
                except (StoreError, OSError):
                    pass  # best-effort cleanup: the real outcome is the one above
