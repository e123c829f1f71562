"""Replicated Redis topologies for tests: a Redis Cluster and a Sentinel group, from the same binary.

Both are built from the ``redis-server`` that ``scripts/setup.sh`` installs
(Sentinel is ``redis-server <conf> --sentinel``; the Cluster is formed with
``CLUSTER ADDSLOTSRANGE / MEET / REPLICATE`` over redis-py, so no
``redis-cli`` is needed). All nodes listen on loopback free ports and require
a password (AUTH), so every test on them also exercises AUTH.

* ``RedisClusterGroup``: 3 masters + 3 replicas, ``cluster-node-timeout`` 1 s.
* ``SentinelGroup``: 1 master, 1 replica, 3 Sentinels (quorum 2, down after 1 s).

Each offers ``overrides()`` (the proxy's ``redis.*`` settings for the mode),
``flushall()``, ``kill_master(...)`` (SIGKILL), ``wait_promoted()`` and
``restore()`` (the killed node comes back and rejoins as a replica). Every
wait is bounded.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import redis as redis_sync
from redis.crc import key_slot

from tests.support.servers import RedisServer, ServerStartError, free_port

PASSWORD = "fleet-pw"
SLOTS = 16384


def _until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while True:
        try:
            result = predicate()
        except (redis_sync.RedisError, OSError):
            result = None
        if result:
            return result
        if time.monotonic() >= end:
            raise ServerStartError(f"timed out waiting for {what}")
        time.sleep(0.05)


class _Node(RedisServer):
    """A password-protected redis-server (``--masterauth`` too, so replicas can sync)."""

    def __init__(self, data_dir: Path, extra: list[str]) -> None:
        super().__init__(data_dir=data_dir, extra_args=["--requirepass", PASSWORD, "--masterauth", PASSWORD,
                                                        *extra])

    def client(self, **kwargs):
        return redis_sync.Redis(host="127.0.0.1", port=self.port, password=PASSWORD, **kwargs)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no last replication or persistence."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=5)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class RedisClusterGroup:
    mode = "cluster"

    def __init__(self, base: Path, masters: int = 3) -> None:
        self.nodes: list[_Node] = []
        self.bus_ports: list[int] = []
        for i in range(masters * 2):
            directory = base / f"node{i}"
            directory.mkdir(parents=True, exist_ok=True)
            self.nodes.append(_Node(directory, ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                                "--cluster-port", str(self._bus_port()),
                                                "--cluster-node-timeout", "1000",
                                                "--cluster-replica-validity-factor", "0"]))
        self.masters = masters
        self.killed: _Node | None = None

    def _bus_port(self) -> int:
        self.bus_ports.append(free_port())
        return self.bus_ports[-1]

    def start(self) -> "RedisClusterGroup":
        for node in self.nodes:
            node.start()
        first = self.nodes[0].client()
        per = SLOTS // self.masters
        for i, node in enumerate(self.nodes[:self.masters]):
            high = SLOTS - 1 if i == self.masters - 1 else (i + 1) * per - 1
            node.client().execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, high)
        for node, bus_port in zip(self.nodes[1:], self.bus_ports[1:]):
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus_port)
        _until(lambda: all(int(n.client().cluster("info")["cluster_known_nodes"]) == len(self.nodes)
                           for n in self.nodes), 20, "every cluster node to know every other")
        for master, replica in zip(self.nodes[:self.masters], self.nodes[self.masters:]):
            master_id = master.client().execute_command("CLUSTER", "MYID").decode()
            _until(lambda: replica.client().execute_command("CLUSTER", "REPLICATE", master_id), 20,
                   f"node {replica.port} to replicate {master.port}")
        self.wait_healthy()
        return self

    def wait_healthy(self, timeout: float = 30) -> None:
        """Every live node says cluster_state:ok and every master has a connected replica."""
        def healthy() -> bool:
            live = [n for n in self.nodes if n.running]
            if not all(n.client().cluster("info")["cluster_state"] == "ok" for n in live):
                return False
            roles = {n.port: n.client().info("replication") for n in live}
            masters = [n for n in live if roles[n.port]["role"] == "master"]
            return len(masters) == self.masters and all(roles[n.port]["connected_slaves"] >= 1 for n in masters) \
                and all(info.get("master_link_status") == "up" and not info.get("master_sync_in_progress")
                        for info in roles.values() if info["role"] == "slave")
        _until(healthy, timeout, "a healthy cluster (3 masters, each with a replica)")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def overrides(self) -> dict[str, Any]:
        return {"redis.mode": "cluster", "redis.cluster_nodes": [n.address for n in self.nodes[:2]],
                "redis.password": PASSWORD}

    def live_masters(self) -> list[_Node]:
        return [n for n in self.nodes if n.running and n.client().info("replication")["role"] == "master"]

    def flushall(self) -> None:
        for node in self.live_masters():
            node.client().flushall()

    def master_of(self, key: str) -> _Node:
        slot = key_slot(key.encode())
        for node in self.live_masters():
            for low, high, master, *_ in node.client().execute_command("CLUSTER", "SLOTS"):
                if low <= slot <= high and int(master[1]) == node.port:
                    return node
        raise AssertionError(f"no live master owns slot {slot}")

    def kill_master(self, node: _Node) -> None:
        self.killed = node
        node.kill()

    def wait_promoted(self, timeout: float = 30) -> None:
        """A replica of the killed master took over its slots; the cluster is ok again."""
        def promoted() -> bool:
            live = [n for n in self.nodes if n.running]
            return len([n for n in live if n.client().info("replication")["role"] == "master"]) == self.masters \
                and all(n.client().cluster("info")["cluster_state"] == "ok" for n in live)
        _until(promoted, timeout, "a replica promoted in place of the killed master")

    def restore(self) -> None:
        """Restart the killed node: it rejoins as a replica of the promoted one."""
        if self.killed is not None:
            self.killed.start()
            self.killed = None
        self.wait_healthy()


class _Sentinel(RedisServer):
    name = "sentinel"

    def __init__(self, data_dir: Path, master_port: int) -> None:
        super().__init__(data_dir=data_dir)
        self.master_port = master_port
        self.conf = data_dir / "sentinel.conf"

    def _command(self) -> list[str]:
        if not self.conf.exists():  # Sentinel rewrites its file; keep what it learnt across restarts
            self.conf.write_text(
                f"port {self.port}\nbind 127.0.0.1\ndir {self.data_dir}\n"
                f"sentinel monitor mymaster 127.0.0.1 {self.master_port} 2\n"
                f"sentinel auth-pass mymaster {PASSWORD}\n"
                "sentinel down-after-milliseconds mymaster 1000\n"
                "sentinel failover-timeout mymaster 5000\n"
                "sentinel parallel-syncs mymaster 1\n")
        return [self.binary, str(self.conf), "--sentinel"]

    def client(self, **kwargs):
        return redis_sync.Redis(host="127.0.0.1", port=self.port, **kwargs)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class SentinelGroup:
    mode = "sentinel"
    service = "mymaster"

    def __init__(self, base: Path) -> None:
        self.master = _Node(_mkdir(base / "master"), [])
        self.replica = _Node(_mkdir(base / "replica"), [])
        self.replica.extra_args += ["--replicaof", "127.0.0.1", str(self.master.port)]
        self.sentinels = [_Sentinel(_mkdir(base / f"sentinel{i}"), self.master.port) for i in range(3)]
        self.killed: _Node | None = None

    @property
    def nodes(self) -> list[_Node]:
        return [self.master, self.replica]

    def start(self) -> "SentinelGroup":
        self.master.start()
        self.replica.start()
        for sentinel in self.sentinels:
            sentinel.start()
        self.wait_healthy()
        return self

    def current_master(self) -> _Node:
        host, port = self.sentinels[0].client().sentinel_get_master_addr_by_name(self.service)
        return next(n for n in self.nodes if n.port == int(port))

    def wait_healthy(self, timeout: float = 60) -> None:
        """Sentinels agree on a live master that has a connected replica, and know each other."""
        def healthy() -> bool:
            masters = {s.client().sentinel_get_master_addr_by_name(self.service) for s in self.sentinels}
            if len(masters) != 1:
                return False
            master = self.current_master()
            state = self.sentinels[0].client().sentinel_master(self.service)
            return master.running and master.client().info("replication")["connected_slaves"] >= 1 \
                and int(state["num-other-sentinels"]) == 2 and int(state["num-slaves"]) >= 1 \
                and all(int(s.client().sentinel_master(self.service)["num-other-sentinels"]) == 2
                        for s in self.sentinels)
        _until(healthy, timeout, "a healthy sentinel group (master with a replica, 3 sentinels)")

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.stop()
        for node in self.nodes:
            node.stop()

    def overrides(self) -> dict[str, Any]:
        return {"redis.mode": "sentinel", "redis.sentinels": [s.address for s in self.sentinels],
                "redis.sentinel_service": self.service, "redis.password": PASSWORD}

    def flushall(self) -> None:
        self.current_master().client().flushall()

    def master_of(self, key: str) -> _Node:
        return self.current_master()

    def kill_master(self, node: _Node) -> None:
        self.killed = node
        node.kill()

    def wait_promoted(self, timeout: float = 30) -> None:
        killed = self.killed
        _until(lambda: self.current_master() is not killed
               and self.current_master().client().info("replication")["role"] == "master",
               timeout, "Sentinel to promote the replica")

    def restore(self) -> None:
        """Restart the killed master: the Sentinels turn it into a replica of the promoted one."""
        if self.killed is not None:
            self.killed.start()
            self.killed = None
        self.wait_healthy()


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
