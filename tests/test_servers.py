"""The server fixtures start real OPA and Redis processes."""

from __future__ import annotations

import os
import stat

import pytest

from tests.support.servers import OpaServer, RedisServer, free_port


def test_opa_put_policy_and_query(opa_server):
    opa_server.put_policy(
        "test_servers_probe",
        "package test_servers.probe\n\n"
        "default allow := false\n\n"
        'allow if input.user == data.test_servers.admin\n',
    )
    opa_server.put_data("test_servers/admin", "alice")
    try:
        assert opa_server.query("test_servers/probe/allow", {"user": "alice"}) is True
        assert opa_server.query("test_servers/probe/allow", {"user": "bob"}) is False
    finally:
        opa_server.delete_policy("test_servers_probe")


def test_opa_stop_then_start_same_socket():
    server = OpaServer()
    server.start()
    try:
        url = server.url
        assert url.startswith("unix:///") and stat.S_IMODE(os.stat(os.path.dirname(server.socket_path)).st_mode) == 0o700
        server.put_policy("p", "package restart\n\nvalue := 42\n")
        assert server.query("restart/value") == 42

        server.stop()
        assert not server.running
        with pytest.raises(OSError):
            server.request("GET", "/health", timeout=1)

        server.start()
        assert server.running and server.url == url
        assert server.request("GET", "/health", timeout=2)[0] == 200
        # in-memory policies do not survive a restart
        assert server.query("restart/value") is None
    finally:
        server.stop()


def test_redis_set_get(redis_server, redis_url):
    assert redis_url == redis_server.url
    client = redis_server.client()
    try:
        assert client.set("toolproxy:probe", "v1")
        assert client.get("toolproxy:probe") == b"v1"
    finally:
        client.close()


def test_redis_url_fixture_flushes(redis_server, redis_url):
    # test_redis_set_get left a key behind; the redis_url fixture flushed it.
    client = redis_server.client()
    try:
        assert client.get("toolproxy:probe") is None
    finally:
        client.close()


def test_redis_restart_keeps_appendonly_data(tmp_path):
    server = RedisServer(
        port=free_port(), data_dir=tmp_path, extra_args=["--appendonly", "yes"]
    )
    server.start()
    try:
        c = server.client()
        c.set("k", "persisted")
        c.close()
        server.stop()
        assert not server.running
        server.start()
        c = server.client()
        assert c.get("k") == b"persisted"
        c.close()
    finally:
        server.stop()
