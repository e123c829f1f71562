"""The serving process's OPA control plane (``OpaControl``: readiness and the catalog push) against a real
OPA and against misbehaving peers: each request bounded by its timeout, a PUT sent again only on a
connection error or a 500/502/504, at most ``retries`` times, every refusal a ``ControlError``."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from proxy.config import load_config
from proxy.policy.opa_control import ControlError, OpaControl
from proxy.wire.http import HttpWire
from tests.support.servers import OpaServer, free_port
from tests.support.stack import REPO


class Peer:
    """A local HTTP peer answering each request with the next status of ``statuses`` (the last one repeats),
    or never (``None``); counts what it was asked."""

    def __init__(self, statuses: list[int | None]) -> None:
        self.statuses = statuses
        self.seen: list[tuple[str, str, str]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.closing = asyncio.Event()

    async def answer(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((request.method, request.path, request.headers.get("Authorization", "")))
        status = self.statuses[min(len(self.seen), len(self.statuses)) - 1]
        if status is None:
            await self.closing.wait()  # never answers: the caller's timeout ends the request
        return web.Response(status=status)

    async def __aenter__(self) -> "Peer":
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.answer)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        self.closing.set()
        await self.runner.cleanup()


@pytest.fixture
async def control():
    """Makes ``OpaControl``s as the runtime does: on a wire of their own that reaches ``opa.url``."""
    wires: list[HttpWire] = []

    def control(url: str, **options) -> OpaControl:
        opa = load_config(env={}, overrides={"opa.url": url}).opa
        wires.append(HttpWire(unix_socket=opa.socket_path))
        return OpaControl(opa.http_base, wires[-1], **options)

    yield control
    for wire in wires:
        await wire.close()


async def test_a_real_opa_takes_the_catalog_from_the_proxys_token_only(control):
    with OpaServer([REPO / "policies", REPO / "examples" / "opa"]) as opa:
        opa_control = control(opa.url, timeout_s=5.0, retries=2, token=opa.token)
        assert await opa_control.healthy()
        await opa_control.put_data("toolproxy/catalog", {"digest": "probe"})
        assert opa._request("GET", "/v1/data/toolproxy/catalog")[1]["result"] == {"digest": "probe"}
        with pytest.raises(ControlError, match="HTTP 401"):  # any other path: refused, not sent again
            await opa_control.put_data("toolproxy/subjects", {})
        with pytest.raises(ControlError, match="HTTP 401"):  # no token: refused
            await control(opa.url, timeout_s=5.0, retries=2).put_data("toolproxy/catalog", {})
        assert await control(opa.url, timeout_s=5.0).healthy()  # /health answers anyone


async def test_health_of_a_peer_that_never_answers_is_false_within_its_timeout(control):
    async with Peer([None]) as peer:
        opa_control = control(peer.url, timeout_s=0.2)
        assert await asyncio.wait_for(opa_control.healthy(), 5) is False
        assert [s[:2] for s in peer.seen] == [("GET", "/health")]


async def test_health_of_nothing_listening_is_false(control):
    async with Peer([200]) as peer:
        url = peer.url
    assert await control(url, timeout_s=1.0).healthy() is False


async def test_a_put_is_sent_again_after_a_5xx_at_most_retries_times(control):
    async with Peer([502, 500, 204]) as peer:
        await control(peer.url, timeout_s=1.0, retries=2, token="t0k").put_data("toolproxy/catalog", {})
        assert peer.seen == [("PUT", "/v1/data/toolproxy/catalog", "Bearer t0k")] * 3
    async with Peer([504]) as peer:
        with pytest.raises(ControlError, match=r"data\.toolproxy\.catalog \(HTTP 504\)"):
            await control(peer.url, timeout_s=1.0, retries=2).put_data("toolproxy/catalog", {})
        assert len(peer.seen) == 3


async def test_a_refused_or_unanswered_put_is_not_sent_again(control):
    async with Peer([400]) as peer:
        with pytest.raises(ControlError, match="HTTP 400"):
            await control(peer.url, timeout_s=1.0, retries=2).put_data("toolproxy/catalog", {})
        assert len(peer.seen) == 1
    async with Peer([None]) as peer:  # a timeout: OPA may have taken it; not sent again, reported
        with pytest.raises(ControlError, match="TimeoutError"):
            await asyncio.wait_for(control(peer.url, timeout_s=0.2, retries=2).put_data("x", {}), 5)
        assert len(peer.seen) == 1
