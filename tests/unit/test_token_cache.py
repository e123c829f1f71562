"""The token cache alone (proxy/credentials/cache.py): kept until shortly before expiry, one fetch per key however
many wait, a waiter's own deadline, no failure kept, least recently used out first."""

from __future__ import annotations

import asyncio

import pytest

from proxy.credentials.cache import TokenCache
from proxy.credentials.token_endpoint import Token


class Issuer:
    """Issues numbered tokens of a given lifetime; ``gate`` holds each fetch until it is set."""

    def __init__(self, lifetime_s: float = 300.0) -> None:
        self.lifetime_s = lifetime_s
        self.fetches = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail = False

    async def fetch(self) -> Token:
        self.fetches += 1
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("refused")
        return Token(f"token-{self.fetches}", self.lifetime_s)


async def test_a_token_is_kept_until_refresh_before_its_expiry_then_fetched_again(monkeypatch):
    loop = asyncio.get_running_loop()
    now = [loop.time()]
    monkeypatch.setattr(loop, "time", lambda: now[0])  # the cache's clock is the loop's: moved by hand
    issuer = Issuer(lifetime_s=2.0)
    cache = TokenCache(refresh_before_s=1.5, max_entries=10)  # at most half the life: kept 1 s
    assert await cache.get("k", issuer.fetch, 1) == "token-1"
    now[0] += 0.99
    assert await cache.get("k", issuer.fetch, 1) == "token-1" and issuer.fetches == 1
    now[0] += 0.02
    assert await cache.get("k", issuer.fetch, 1) == "token-2" and issuer.fetches == 2


async def test_one_fetch_for_every_caller_of_a_key_and_a_waiter_gives_up_alone():
    issuer = Issuer()
    issuer.gate.clear()
    cache = TokenCache(refresh_before_s=30, max_entries=10)
    impatient = asyncio.ensure_future(cache.get("k", issuer.fetch, 0.05))
    patient = [asyncio.ensure_future(cache.get("k", issuer.fetch, 5)) for _ in range(20)]
    with pytest.raises(TimeoutError):
        await impatient
    issuer.gate.set()
    assert set(await asyncio.gather(*patient)) == {"token-1"} and issuer.fetches == 1


async def test_a_failure_is_not_kept_and_the_oldest_key_goes_first():
    issuer = Issuer()
    cache = TokenCache(refresh_before_s=30, max_entries=2)
    issuer.fail = True
    with pytest.raises(RuntimeError):
        await cache.get("k", issuer.fetch, 1)
    issuer.fail = False
    assert await cache.get("k", issuer.fetch, 1) == "token-2"  # asked again, not the failure
    await cache.get("a", issuer.fetch, 1)
    await cache.get("k", issuer.fetch, 1)  # k used last: a is the least recently used
    await cache.get("b", issuer.fetch, 1)
    assert len(cache) == 2
    fetches = issuer.fetches
    assert await cache.get("k", issuer.fetch, 1) == "token-2" and issuer.fetches == fetches
    await cache.get("a", issuer.fetch, 1)
    assert issuer.fetches == fetches + 1  # a was dropped
