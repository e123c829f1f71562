"""The hot path's HTTP/1.1 wire (proxy/wire/http.py) against raw TCP servers that answer byte for byte.

Each server is an ``asyncio`` stream server on a free port that reads one request head and body at a time
and writes exactly the bytes a test gives it, so framing (Content-Length, chunked, close-delimited),
keep-alive, stale connections, limits and refusals are all exercised on a real socket. Every wait is
bounded by ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import pytest

from proxy.wire.http import HttpWire, Progress, TooLarge, WireError

Handler = Callable[[bytes, bytes, asyncio.StreamWriter], Awaitable[bool]]  # (head, body, writer) -> keep going


class RawServer:
    def __init__(self, handler: Handler, unix_path: str | None = None) -> None:
        self.handler = handler
        self.unix_path = unix_path  # listen on this Unix socket instead of a TCP port
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> "RawServer":
        if self.unix_path is not None:
            self.server = await asyncio.start_unix_server(self._serve, self.unix_path)
        else:
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/data/x"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                if not await self.handler(head, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def answer(body: bytes, *extra: bytes) -> Handler:
    async def handler(head: bytes, request: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + b"".join(e + b"\r\n" for e in extra)
                     + b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        await writer.drain()
        return True
    return handler


async def test_one_keep_alive_connection_serves_sequential_posts_with_the_given_headers():
    wire = HttpWire()
    async with RawServer(answer(b'{"result":1}', b"X-Request-Id: r-1")) as server:
        async with asyncio.timeout(10):
            for _ in range(5):
                got = await wire.post(server.url, b'{"a":1}', [("X-Call-Id", "c-1")])
                assert (got.status, got.body, got.headers["x-request-id"]) == (200, b'{"result":1}', "r-1")
        assert server.connections == 1
        head, body = server.requests[0]
        assert head.startswith(b"POST /v1/data/x HTTP/1.1\r\n") and b"\r\nX-Call-Id: c-1\r\n" in head
        assert b"\r\nUser-Agent: toolproxy/" in head and body == b'{"a":1}'
    await wire.close()


async def test_credentials_in_the_url_go_as_basic_auth_and_not_in_the_host():
    async with asyncio.timeout(10), RawServer(answer(b"{}")) as server:
        wire = HttpWire()
        await wire.post(server.url.replace("http://", "http://opa%40ops:s%3Acret@"), b"{}")
        head = server.requests[0][0]
        assert b"\r\nAuthorization: Basic b3BhQG9wczpzOmNyZXQ=\r\n" in head  # base64 of opa@ops:s:cret
        assert b"\r\nHost: 127.0.0.1:" in head and b"cret@" not in head
        await wire.close()


async def test_chunked_and_close_delimited_bodies_are_read_to_their_end():
    async def chunked(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n\r\n")
        return True

    async def until_close(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"b\":2}")
        await writer.drain()
        return False  # the server closes: that ends the body

    wire = HttpWire()
    async with asyncio.timeout(10):
        async with RawServer(chunked) as server:
            assert (await wire.post(server.url, b"{}")).body == b'{"a":1}'
            assert (await wire.post(server.url, b"{}")).body == b'{"a":1}'
            assert server.connections == 1
        async with RawServer(until_close) as server:
            assert (await wire.post(server.url, b"{}")).body == b'{"b":2}'
            assert (await wire.post(server.url, b"{}")).body == b'{"b":2}'
            assert server.connections == 2  # the answer ended with its connection: a fresh one each time
    await wire.close()


async def test_a_reused_connection_closed_before_answering_is_retried_only_when_the_caller_allows_it():
    async def second_request_unanswered(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        if len(server.requests) % 2 == 0:  # every second request on the wire: read, then closed unanswered
            return False
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        return True

    async with asyncio.timeout(10), RawServer(second_request_unanswered) as server:
        wire = HttpWire()
        await wire.post(server.url, b"{}")  # request 1: answered, the connection pooled
        assert (await wire.post(server.url, b"{}", retry_stale=True)).status == 200  # 2 dropped, 3 on a fresh one
        assert (len(server.requests), server.connections) == (3, 2)
        progress = Progress()
        with pytest.raises(WireError):  # request 4 dropped on the reused connection: not sent again
            await wire.post(server.url, b"{}", progress=progress)
        assert progress.sent and len(server.requests) == 4
        await wire.close()


async def test_an_answer_past_the_limit_is_refused_and_its_connection_closed():
    async with asyncio.timeout(10), RawServer(answer(b"x" * 5000)) as server:
        wire = HttpWire()
        with pytest.raises(TooLarge) as refused:
            await wire.post(server.url, b"{}", max_body=1000)
        assert refused.value.status == 200
        assert (await wire.post(server.url, b"{}", max_body=10_000)).body == b"x" * 5000
        assert server.connections == 2
        await wire.close()


async def test_a_second_answer_to_one_request_closes_the_connection_instead_of_answering_the_next():
    async def twice(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n%b" % body
                     + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale")
        await writer.drain()
        return True

    async with asyncio.timeout(10), RawServer(twice) as server:
        wire = HttpWire()
        assert (await wire.post(server.url, b"{}")).body == b"{}"
        assert (await wire.post(server.url, b"[]")).body == b"[]"  # not the first request's extra "stale"
        assert server.connections == 2
        await wire.close()


async def test_an_answer_that_is_not_http_is_a_wire_error():
    async def garbage(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        return True

    async with asyncio.timeout(10), RawServer(garbage) as server:
        wire = HttpWire()
        progress = Progress()
        with pytest.raises(WireError):
            await wire.post(server.url, b"{}", progress=progress)
        assert progress.sent  # it was on the wire: whatever it did is unknown
        await wire.close()


async def test_a_timed_out_exchange_closes_its_connection_instead_of_reusing_it():
    slow = asyncio.Event()

    async def late(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        if not slow.is_set():
            slow.set()
            await asyncio.sleep(0.5)  # answers after the client gave up: that answer must not be read
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n" + (b'"late"\n' if len(body) == 1 else b'"next"\n'))
        return True

    async with asyncio.timeout(10), RawServer(late) as server:
        wire = HttpWire()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await wire.post(server.url, b"1")
        assert (await wire.post(server.url, b"22")).body == b'"next"\n'
        assert server.connections == 2
        await wire.close()


async def test_connections_are_capped_and_a_request_past_the_cap_waits_for_one():
    async def slowish(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        return True

    async with asyncio.timeout(10), RawServer(slowish) as server:
        wire = HttpWire(max_connections=2)
        answers = await asyncio.gather(*(wire.post(server.url, b"{}") for _ in range(6)))
        assert [a.status for a in answers] == [200] * 6
        assert server.connections == 2
        await wire.close()


async def test_at_the_cap_an_idle_connection_to_another_origin_gives_up_its_slot():
    async with asyncio.timeout(10), RawServer(answer(b"{}")) as a, RawServer(answer(b"[]")) as b:
        wire = HttpWire(max_connections=1)
        assert (await wire.post(a.url, b"{}")).body == b"{}"
        assert (await wire.post(b.url, b"{}")).body == b"[]"  # a's idle connection retired for b's
        assert (await wire.post(a.url, b"{}")).body == b"{}"
        assert (a.connections, b.connections, wire.open_connections) == (2, 1, 1)
        await asyncio.sleep(0.05)  # the retired connections' close reaches the wire: counted once only
        assert wire.open_connections == 1
        await wire.close()


async def test_refused_connections_and_bad_header_values_send_nothing():
    wire = HttpWire()
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    progress = Progress()
    async with asyncio.timeout(10):
        with pytest.raises(OSError):
            await wire.post(f"http://127.0.0.1:{port}/", b"{}", progress=progress)
    assert not progress.connected and not progress.sent
    with pytest.raises(ValueError):
        await wire.post(f"http://127.0.0.1:{port}/", b"{}", [("X-Call-Id", "a\r\nX-Evil: 1")])
    with pytest.raises(ValueError):
        await wire.post("ftp://127.0.0.1/", b"{}")
    assert wire.open_connections == 0  # no connection counted for what was never opened
    await wire.close()


class Feed:
    def __init__(self) -> None:
        self.seen = b""

    def feed(self, chunk: bytes):
        self.seen += chunk
        return "got it" if b"\n\n" in self.seen else None

    def end(self) -> Exception:
        return WireError("ended without the event")


async def test_an_event_stream_is_fed_until_the_feed_has_its_event_and_a_refusal_is_not_waited_for():
    async def stream(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        status = b"200 OK" if body == b"ok" else b"500 Internal Server Error"
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"6\r\n: ping\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"c\r\ndata: 1\n\n...\r\n")
        await asyncio.sleep(30)  # the stream stays open: the feed's event must end the exchange
        return False

    async with asyncio.timeout(10), RawServer(stream) as server:
        wire = HttpWire()
        got = await wire.post(server.url, b"ok", feed=Feed())
        assert (got.status, got.event) == (200, "got it")
        refused = await wire.post(server.url, b"no", feed=Feed())
        assert (refused.status, refused.event) == (500, None)
        assert wire.open_connections == 0  # both connections closed (their streams were left unread)
        await wire.close()


def _tls_files(tmp_path):
    """A CA and a server certificate for 127.0.0.1 signed by it (cryptography, a PyJWT[crypto] dependency)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject: str, key, issuer: str, issuer_key, *, ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(hours=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            builder = builder.add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                decipher_only=False), critical=True)
        else:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("test CA", ca_key, "test CA", ca_key, ca=True)
    server = cert("127.0.0.1", server_key, "test CA", ca_key, ca=False)
    pem = serialization.Encoding.PEM
    (tmp_path / "ca.pem").write_bytes(ca.public_bytes(pem))
    (tmp_path / "server.pem").write_bytes(server.public_bytes(pem))
    (tmp_path / "server.key").write_bytes(server_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"


async def test_https_is_verified_against_the_system_trust_store(tmp_path, monkeypatch):
    import ssl

    ca, certificate, key = _tls_files(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certificate, key)
    handler = answer(b'{"tls":true}')

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await handler(head, await reader.readexactly(length), writer)
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/tools/x"
    try:
        async with asyncio.timeout(10):
            untrusted, refusing = Progress(), HttpWire()
            with pytest.raises(OSError):  # a certificate no trusted CA signed: refused before a byte is sent
                await refusing.post(url, b"{}", progress=untrusted)
            await asyncio.sleep(0.05)  # whatever the transport reports after the failed handshake has arrived
            assert not untrusted.sent and refusing.open_connections == 0
            monkeypatch.setenv("SSL_CERT_FILE", str(ca))  # the trust store a deployment mounts
            wire = HttpWire()
            got = await wire.post(url, b"{}")
            assert (got.status, got.body) == (200, b'{"tls":true}')
            await wire.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_a_unix_socket_wire_sends_every_method_there_within_the_same_limits(tmp_path):
    path = str(tmp_path / "opa.sock")
    wire = HttpWire(unix_socket=path)
    async with asyncio.timeout(10):
        with pytest.raises(FileNotFoundError):  # nothing listens yet: no connection, nothing sent
            await wire.request("GET", "http://localhost/health")
        async with RawServer(answer(b"{}"), unix_path=path) as server:
            assert (await wire.request("GET", "http://localhost/health")).status == 200
            assert (await wire.request("PUT", "http://localhost/v1/data/x", b'{"a":1}')).status == 200
            assert (await wire.post("http://localhost/v1/data/x", b"{}")).status == 200
            assert server.connections == 1  # one keep-alive connection for all three
            heads = [head.split(b"\r\n")[:2] for head, _ in server.requests]
            assert heads == [[b"GET /health HTTP/1.1", b"Host: localhost"],
                             [b"PUT /v1/data/x HTTP/1.1", b"Host: localhost"],
                             [b"POST /v1/data/x HTTP/1.1", b"Host: localhost"]]
        async with RawServer(answer(b"x" * 5000), unix_path=path + "2"):
            big = HttpWire(unix_socket=path + "2")
            with pytest.raises(TooLarge):
                await big.post("http://localhost/v1/data/x", b"{}", max_body=1000)
            await big.close()
        with pytest.raises(ValueError):  # a socket is plain HTTP
            await wire.post("https://localhost/v1/data/x", b"{}")
    await wire.close()
