"""A Redis that may evict is not a state store (seed 000 §5; proxy/eviction.py).

Real ``redis-server`` processes in each ``maxmemory-policy``: only ``noeviction`` is accepted; every other
policy (the ``volatile-*`` ones too: records carry a TTL) stops the proxy at start-up with one line and
makes ``/readyz`` not ready, unless ``redis.accept_eviction`` says otherwise by name. Evictions are counted.
The duplicate-effect test is the reason: with eviction forced, an evicted operation record lets a
same-key retry run a write a second time at a backend that does not deduplicate.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from redis.exceptions import OutOfMemoryError

from proxy.config import ConfigError, load_config
from proxy.fronts.app import create_runtime
from tests.support.metrics import sample, samples, scrape_text
from tests.support.modes import all_redis_modes
from tests.support.proxyproc import fleet_key_env
from tests.support.servers import RedisServer, free_port
from tests.support.stack import DEMO_REGISTRY, REPO, UNLOCKED_COUNTER, extra_tools, running_stack

EVICTING = ("allkeys-lru", "allkeys-lfu", "allkeys-random", "volatile-lru", "volatile-lfu", "volatile-random",
            "volatile-ttl")
FILLER_BYTES = 64 * 1024
FILL_ROUNDS = 400  # at most 400 x 20 x 64 KiB written into an 8 MiB Redis before the test gives up


@pytest.fixture(scope="module")
def small_redis(tmp_path_factory):
    """One redis-server with ``maxmemory 8mb``; each test sets its policy (CONFIG SET) on flushed data."""
    server = RedisServer(data_dir=tmp_path_factory.mktemp("small-redis"),
                         extra_args=["--maxmemory", "8mb", "--maxmemory-policy", "noeviction"])
    server.start()
    try:
        yield server
    finally:
        server.stop()


def use_policy(server: RedisServer, policy: str) -> None:
    client = server.client()
    try:
        client.flushall()
        client.config_set("maxmemory-policy", policy)
        assert client.info("memory")["maxmemory_policy"] == policy
    finally:
        client.close()


def evicted_keys(server: RedisServer) -> int:
    client = server.client()
    try:
        return int(client.info("stats")["evicted_keys"])
    finally:
        client.close()


def settings(server: RedisServer, **more):
    return load_config(env={}, overrides={"redis.url": server.url, "identity.mode": "static",
                                          "registry.paths": [str(DEMO_REGISTRY)], **more})


async def readiness(stack):
    async with stack.session.get(stack.ops_url + "/readyz") as response:
        return response.status, await response.json()


@pytest.mark.parametrize("policy", EVICTING)
async def test_start_up_refuses_every_policy_that_may_evict_with_one_line(small_redis, policy):
    use_policy(small_redis, policy)
    with pytest.raises(ConfigError) as refused:
        await create_runtime(settings(small_redis))
    line = str(refused.value)
    assert "\n" not in line
    assert f"maxmemory-policy {policy} on 127.0.0.1:{small_redis.port}" in line
    assert "noeviction" in line and "redis.accept_eviction" in line


async def test_noeviction_is_accepted_and_ready(small_redis, opa_server):
    use_policy(small_redis, "noeviction")
    async with running_stack({"redis.url": small_redis.url, **opa_server.settings}) as stack:
        status, body = await readiness(stack)
        assert (status, body["checks"]) == (200, {"opa": True, "redis": True, "redis_policy": True,
                                                  "registry": True})
        metrics = samples(await scrape_text(stack))
        assert metrics[sample("toolproxy_redis_evicting_masters")] == 0
        assert metrics[sample("toolproxy_redis_evicted_keys_total")] == 0


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl", "allkeys-random"])
async def test_accept_eviction_lets_the_proxy_run_and_says_so(small_redis, opa_server, policy, caplog):
    use_policy(small_redis, policy)
    with caplog.at_level(logging.WARNING, logger="toolproxy.eviction"):
        async with running_stack({"redis.url": small_redis.url, **opa_server.settings,
                                  "redis.accept_eviction": True}) as stack:
            status, body = await readiness(stack)
            assert status == 200 and body["checks"]["redis_policy"] is True
            assert samples(await scrape_text(stack))[sample("toolproxy_redis_evicting_masters")] == 1
    warnings = [r.getMessage() for r in caplog.records if r.name == "toolproxy.eviction"]
    assert len(warnings) == 1 and f"{policy} on 127.0.0.1:{small_redis.port}" in warnings[0]
    assert "accepted by redis.accept_eviction" in warnings[0]


async def test_readiness_turns_not_ready_when_a_master_changes_policy_and_back(small_redis, opa_server, caplog):
    use_policy(small_redis, "noeviction")
    async with running_stack({"redis.url": small_redis.url, **opa_server.settings}) as stack:
        assert (await stack.runtime.health.readiness(use_cache=False)).ready
        client = small_redis.client()
        try:
            with caplog.at_level(logging.INFO, logger="toolproxy.eviction"):
                client.config_set("maxmemory-policy", "volatile-lru")
                for _ in range(3):  # one line per change of verdict, not one per probe
                    refused = await stack.runtime.health.readiness(use_cache=False)
                    assert not refused.ready
                    assert refused.checks == {"opa": True, "redis": True, "redis_policy": False, "registry": True}
                status, body = await readiness(stack)
                assert status == 503 and body["checks"]["redis_policy"] is False
                assert "127.0.0.1" not in str(body)  # a probe answer never names a host
                client.config_set("maxmemory-policy", "noeviction")
                assert (await stack.runtime.health.readiness(use_cache=False)).ready
        finally:
            client.config_set("maxmemory-policy", "noeviction")
            client.close()
    lines = [r for r in caplog.records if r.name == "toolproxy.eviction"]
    assert [r.levelname for r in lines] == ["ERROR", "INFO"]
    assert "volatile-lru" in lines[0].getMessage()


def test_the_sidecar_process_exits_non_zero_with_one_line(small_redis):
    use_policy(small_redis, "allkeys-lru")
    env = {**os.environ, "TOOLPROXY_REDIS_URL": small_redis.url, "TOOLPROXY_IDENTITY_MODE": "static",
           "TOOLPROXY_REGISTRY_PATHS": str(DEMO_REGISTRY), "TOOLPROXY_LISTEN_PORT": str(free_port()),
           "TOOLPROXY_ADMIN_PORT": str(free_port()), "TOOLPROXY_OPS_PORT": str(free_port()), **fleet_key_env()}
    result = subprocess.run([sys.executable, "-m", "proxy.cli", "run"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1
    refusal = [line for line in result.stderr.splitlines() if line.startswith("toolproxy: ")]
    assert refusal == [refusal[0]] and \
        refusal[0].startswith(f"toolproxy: redis: maxmemory-policy allkeys-lru on 127.0.0.1:{small_redis.port}")


# -- the duplicate effect ----------------------------------------------------------------------------------

BUMP = {"counter": "ctr_evict", "delta": 1}


async def write_then_evict_then_retry(stack, server: RedisServer) -> int:
    """One write under a key, its record evicted by other keys filling memory, the same call again: how many
    effects the backend applied. The backend forgets its own Idempotency-Key memory first: a backend that
    does not deduplicate, where the proxy's record is the only thing that makes the retry safe."""
    key = {"Idempotency-Key": "evict-me"}
    status, first = await stack.call("bump_counter", BUMP, headers=key)
    assert (status, first["outcome"]) == (200, "succeeded"), first
    stack.backend.idempotency.clear()
    client = server.client()
    try:
        assert list(client.scan_iter(match="toolproxy:op:*")), "the write left no operation record"
        for round_ in range(FILL_ROUNDS):
            if not list(client.scan_iter(match="toolproxy:op:*")):
                break
            pipe = client.pipeline(transaction=False)
            for i in range(20):
                pipe.set(f"other-app:{round_}:{i}", b"x" * FILLER_BYTES)
            pipe.execute()
        else:
            pytest.fail(f"the operation record survived {FILL_ROUNDS} rounds of filling")
    finally:
        client.close()
    status, again = await stack.call("bump_counter", BUMP, headers=key)
    assert status == 200, again
    return len([e for e in stack.backend.effects if e["tool"] == "adjust_counter"])


async def test_by_default_the_eviction_that_runs_a_write_twice_cannot_happen(small_redis, opa_server, tmp_path):
    """The repro of issue 29 (8a): maxmemory 8mb, allkeys-lru. Before the fix the proxy started here, and the
    retry after the eviction ran the write a second time (2 effects). Now the proxy refuses to start."""
    use_policy(small_redis, "allkeys-lru")
    overrides = {"redis.url": small_redis.url, **opa_server.settings, **extra_tools(tmp_path, UNLOCKED_COUNTER)}
    try:
        async with running_stack(overrides) as stack:
            effects = await write_then_evict_then_retry(stack, small_redis)
    except ConfigError as refused:
        assert "maxmemory-policy allkeys-lru" in str(refused)
        return
    assert effects == 1, f"an evicted operation record let a same-key retry run the write {effects} times"


async def test_with_the_override_the_eviction_happens_and_is_counted(small_redis, opa_server, tmp_path):
    """What ``redis.accept_eviction`` accepts, shown: the record is evicted, the same-key retry runs the write
    again (2 effects), and every eviction Redis made is counted in toolproxy_redis_evicted_keys_total."""
    use_policy(small_redis, "allkeys-lru")
    before = evicted_keys(small_redis)
    async with running_stack({"redis.url": small_redis.url, **opa_server.settings,
                              "redis.accept_eviction": True, **extra_tools(tmp_path, UNLOCKED_COUNTER)}) as stack:
        first = samples(await scrape_text(stack))
        assert first[sample("toolproxy_redis_evicted_keys_total")] == 0
        assert first[sample("toolproxy_redis_evicting_masters")] == 1
        assert await write_then_evict_then_retry(stack, small_redis) == 2
        await stack.runtime.health.readiness(use_cache=False)  # reads INFO now (the scrape may use its cache)
        counted = samples(await scrape_text(stack))[sample("toolproxy_redis_evicted_keys_total")]
        assert counted == evicted_keys(small_redis) - before > 0


async def test_noeviction_under_the_same_pressure_refuses_instead_of_forgetting(small_redis, opa_server, tmp_path):
    """The policy the proxy asks for: a full Redis refuses writes (OOM) instead of dropping keys. The record is
    still there, so a same-key retry is answered from it (one effect, however often the caller retries), and a
    new write is refused before it is sent (dependency_unavailable, nothing attempted)."""
    use_policy(small_redis, "noeviction")
    evicted_before = evicted_keys(small_redis)
    async with running_stack({"redis.url": small_redis.url, **opa_server.settings,
                              **extra_tools(tmp_path, UNLOCKED_COUNTER)}) as stack:
        key = {"Idempotency-Key": "keep-me"}
        status, first = await stack.call("bump_counter", BUMP, headers=key)
        assert (status, first["outcome"]) == (200, "succeeded")
        stack.backend.idempotency.clear()
        client = small_redis.client()
        try:
            # Until Redis refuses ("OOM command not allowed when used memory > 'maxmemory'"): it never drops a
            # key to make room.
            for round_ in range(FILL_ROUNDS):
                try:
                    client.set(f"other-app:{round_}", b"x" * FILLER_BYTES)
                except OutOfMemoryError:
                    break
            else:
                pytest.fail(f"an 8 MiB Redis accepted {FILL_ROUNDS} values of {FILLER_BYTES} bytes")
            assert list(client.scan_iter(match="toolproxy:op:*"))
            # Full for writes of any size: the edge otherwise moves with the clients' buffers.
            client.config_set("maxmemory", int(client.info("memory")["used_memory"]) // 2)
            replays = []
            for _ in range(3):
                status, again = await stack.call("bump_counter", BUMP, headers=key)
                replays.append((again["outcome"], again.get("replayed")))
            # A new write cannot reserve its key in a full Redis: refused before it is sent, safe to retry.
            status, new = await stack.call("bump_counter", BUMP, headers={"Idempotency-Key": "a-new-one"})
        finally:
            client.config_set("maxmemory", "8mb")
            client.close()
        assert replays == [("succeeded", True)] * 3
        assert new["outcome"] == "failed" and new["error"]["code"] == "dependency_unavailable", new
        assert new["side_effect"]["attempted"] is False
        assert len([e for e in stack.backend.effects if e["tool"] == "adjust_counter"]) == 1
        assert evicted_keys(small_redis) == evicted_before


# -- every master, in every mode ---------------------------------------------------------------------------

def master_clients(request, redis_mode):
    """Sync clients of every master of the mode's session topology."""
    if redis_mode == "standalone":
        return [request.getfixturevalue("redis_server").client()]
    if redis_mode == "sentinel":
        return [request.getfixturevalue("redis_sentinel").current_master().client()]
    return [node.client() for node in request.getfixturevalue("redis_cluster").live_masters()]


@all_redis_modes
async def test_every_master_is_read_in_every_mode(request, redis_mode, proxy_deps):
    """One master of the topology (the last Cluster master) on volatile-lru: refused at start-up, naming it;
    accepted by name; and a change after start-up turns readiness off."""
    masters = master_clients(request, redis_mode)
    assert len(masters) == (3 if redis_mode == "cluster" else 1)
    changed = masters[-1]
    port = changed.connection_pool.connection_kwargs["port"]
    name = "sentinel:mymaster" if redis_mode == "sentinel" else f"127.0.0.1:{port}"
    base = {**proxy_deps, "identity.mode": "static", "registry.paths": [str(DEMO_REGISTRY)]}
    try:
        changed.config_set("maxmemory-policy", "volatile-lru")
        with pytest.raises(ConfigError, match=f"maxmemory-policy volatile-lru on {name}"):
            await create_runtime(load_config(env={}, overrides=base))
        async with running_stack({**proxy_deps, "redis.accept_eviction": True}) as stack:
            readiness = await stack.runtime.health.readiness(use_cache=False)
            assert readiness.ready and readiness.checks["redis_policy"]
            assert samples(await scrape_text(stack))[sample("toolproxy_redis_evicting_masters")] == 1
        changed.config_set("maxmemory-policy", "noeviction")
        async with running_stack(proxy_deps) as stack:
            assert (await stack.runtime.health.readiness(use_cache=False)).ready
            changed.config_set("maxmemory-policy", "allkeys-lfu")
            readiness = await stack.runtime.health.readiness(use_cache=False)
            assert not readiness.ready and readiness.checks == {"opa": True, "redis": True, "redis_policy": False,
                                                                "registry": True}
    finally:
        for client in masters:
            client.config_set("maxmemory-policy", "noeviction")
            client.close()
