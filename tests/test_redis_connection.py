"""Redis password and TLS settings (the chart feeds them from Secrets): real redis-server, real TLS."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import redis as redis_sync
import redis.exceptions

from proxy.config import ConfigError, load_config
from proxy.store import close_client, create_client
from tests.support.servers import RedisServer, free_port


class _AuthRedis(RedisServer):
    """redis-server that needs a password, and optionally speaks only TLS."""

    def __init__(self, password: str, tls: dict[str, Path] | None = None) -> None:
        self.tls = tls
        extra: list[str] = []
        if tls:
            extra += ["--port", "0", "--tls-port", str(free_port()), "--tls-cert-file", str(tls["server_cert"]),
                      "--tls-key-file", str(tls["server_key"]), "--tls-ca-cert-file", str(tls["ca"]),
                      "--tls-auth-clients", "yes"]
        super().__init__(extra_args=extra, password=password)  # RedisServer runs it with --requirepass
        if tls:
            self.port = int(extra[extra.index("--tls-port") + 1])

    def client(self, **kwargs):
        if self.tls:
            kwargs.update(ssl=True, ssl_ca_certs=str(self.tls["ca"]), ssl_certfile=str(self.tls["client_cert"]),
                          ssl_keyfile=str(self.tls["client_key"]), ssl_check_hostname=False)  # readiness probe
        return redis_sync.Redis(host="127.0.0.1", port=self.port, password=self.password, **kwargs)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.crt", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "extendedKeyUsage=clientAuth"),
                      ("other", "subjectAltName=DNS:redis.other.test")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=d)
    return {"ca": d / "ca.crt", "server_cert": d / "server.crt", "server_key": d / "server.key",
            "client_cert": d / "client.crt", "client_key": d / "client.key",
            "other_cert": d / "other.crt", "other_key": d / "other.key"}


async def _ping(config_overrides: dict, env: dict | None = None) -> bool:
    """A script over the hot path's wire (proxy/wire/resp.py) and a PING over redis-py's own connection:
    both authenticate and verify TLS from the same settings."""
    config = load_config(env=env or {}, overrides=config_overrides)
    client = create_client(config.redis)
    try:
        assert await client.register_script("return redis.call('PING')")() == b"PONG"
        return await client.ping()
    finally:
        await close_client(client)


async def test_password_from_the_environment_authenticates():
    with _AuthRedis("s3cr/t@:pw") as server:  # characters that would break a URL
        url = f"redis://127.0.0.1:{server.port}/0"
        assert await _ping({}, env={"TOOLPROXY_REDIS_URL": url, "TOOLPROXY_REDIS_PASSWORD": "s3cr/t@:pw"})
        with pytest.raises(redis.exceptions.AuthenticationError):
            await _ping({"redis.url": url})
        with pytest.raises(redis.exceptions.AuthenticationError):
            await _ping({"redis.url": url, "redis.password": "wrong"})


async def test_mutual_tls_with_ca_and_client_certificate(certs):
    with _AuthRedis("pw", tls=certs) as server:
        url = f"rediss://127.0.0.1:{server.port}/0"
        assert await _ping({"redis.url": url, "redis.password": "pw", "redis.tls_ca_file": str(certs["ca"]),
                            "redis.tls_cert_file": str(certs["client_cert"]),
                            "redis.tls_key_file": str(certs["client_key"])})
        # Without the client certificate the server refuses the handshake.
        with pytest.raises(redis.exceptions.ConnectionError):
            await _ping({"redis.url": url, "redis.password": "pw", "redis.tls_ca_file": str(certs["ca"])})
        # Without the CA the server's certificate is not trusted.
        with pytest.raises(redis.exceptions.ConnectionError):
            await _ping({"redis.url": url, "redis.password": "pw",
                         "redis.tls_cert_file": str(certs["client_cert"]),
                         "redis.tls_key_file": str(certs["client_key"])})


async def test_the_servers_name_is_checked_unless_turned_off_by_name(certs):
    """``redis.tls_check_hostname`` is passed explicitly (true by default): a certificate the CA signed for
    another name is refused on both the wire and redis-py's connection; off, only the CA is checked."""
    other = {**certs, "server_cert": certs["other_cert"], "server_key": certs["other_key"]}
    with _AuthRedis("pw", tls=other) as server:
        settings = {"redis.url": f"rediss://127.0.0.1:{server.port}/0", "redis.password": "pw",
                    "redis.tls_ca_file": str(certs["ca"]), "redis.tls_cert_file": str(certs["client_cert"]),
                    "redis.tls_key_file": str(certs["client_key"])}
        with pytest.raises(redis.exceptions.ConnectionError):
            await _ping(settings)
        assert await _ping({**settings, "redis.tls_check_hostname": False})


def test_tls_files_need_a_rediss_url_and_cert_needs_key():
    with pytest.raises(ConfigError, match="TLS is off"):
        load_config(env={}, overrides={"redis.url": "redis://r:6379/0", "redis.tls_ca_file": "/ca.crt"})
    with pytest.raises(ConfigError, match="go together"):
        load_config(env={}, overrides={"redis.url": "rediss://r:6379/0", "redis.tls_cert_file": "/tls.crt"})
