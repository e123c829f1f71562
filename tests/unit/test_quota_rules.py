"""Quota rules as data: the limit text of the configuration, the registry's form, which limits apply to a call
(pure code, no Redis)."""

from __future__ import annotations

import pytest

from proxy.config import ConfigError, load_config
from proxy.errors import ProxyError
from proxy.quota_rules import LimitSpec, LimitSpecError, QuotaRules, parse_spec, spec_from_registry
from proxy.registry import RegistryError, load_registry
from proxy.quotas import build_rules, retry_after_header
from tests.unit import REPO

DEMO_REGISTRY = REPO / "examples" / "registry"


def test_the_limit_text_reads_rate_burst_concurrency_and_redis_policy():
    spec = parse_spec("rate=10/2s burst=4 concurrency=3 on_redis_error=closed")
    assert (spec.rate, spec.period_ms, spec.bucket, spec.concurrency) == (10, 2000, 4, 3)
    assert spec.emission_ms == 200 and spec.fails_closed(is_write=False)
    assert parse_spec("rate=5").period_ms == 1000 and parse_spec("rate=5").bucket == 5  # burst defaults to rate
    assert parse_spec("rate=1/500ms").period_ms == 500 and parse_spec("rate=3/m").period_ms == 60000
    auto = parse_spec("concurrency=2")
    assert auto.fails_closed(is_write=True) and not auto.fails_closed(is_write=False)  # the idempotency rule


@pytest.mark.parametrize("text", ["", "rate=0", "rate=5/2x", "burst=3", "concurrency=-1", "speed=3", "rate",
                                  "rate=2 on_redis_error=maybe", "rate=2 per=everyone"])
def test_a_bad_limit_text_is_refused(text):
    with pytest.raises(LimitSpecError):
        parse_spec(text)


def test_a_bad_limit_in_the_configuration_stops_with_one_line():
    with pytest.raises(ConfigError, match=r"^quotas\.classes\.slow: rate period"):
        load_config(env={}, overrides={"quotas.classes": {"slow": "rate=1/fortnight"}})
    with pytest.raises(ConfigError, match="breaker_failure_ratio"):
        load_config(env={}, overrides={"quotas.breaker_failure_ratio": 1.5})
    env = load_config(env={"TOOLPROXY_QUOTAS_TENANTS": "acme=rate=5/1s burst=2"})
    assert env.quotas.tenants == {"acme": "rate=5/1s burst=2"}


def test_which_limits_apply_and_what_they_are_named():
    rules = QuotaRules(tools={"t": parse_spec("rate=9")}, backends={"b": parse_spec("concurrency=2")},
                       tenant=parse_spec("rate=100"), tenants={"globex": parse_spec("rate=1")},
                       subject=parse_spec("rate=10"), fleet=parse_spec("rate=1000"),
                       classes={"slow": parse_spec("rate=1"), "team": parse_spec("rate=2 per=tenant")})
    plain = rules.applicable(tenant="acme", subject="al", tool="t", backend="b", quota_class=None)
    assert [(a.name, a.counted_by) for a in plain] == [
        ("tenant", ("tenant", "acme")), ("subject", ("subject", "acme", "al")), ("tool:t", ("tool", "t")),
        ("backend:b", ("backend", "b")), ("fleet", ("fleet",))]
    assert rules.applicable(tenant="globex", subject="g", tool="x", backend="y", quota_class=None)[0].spec.rate == 1
    slow = rules.applicable(tenant="acme", subject="al", tool="x", backend="y", quota_class="slow")
    assert [a.name for a in slow] == ["tenant", "class:slow", "fleet"]  # the class replaces the subject limit
    team = rules.applicable(tenant="acme", subject="al", tool="x", backend="y", quota_class="team")
    assert [a.name for a in team] == ["class:team", "subject", "fleet"]  # per=tenant replaces the tenant's
    with pytest.raises(KeyError):
        rules.applicable(tenant="acme", subject="al", tool="x", backend="y", quota_class="gold")
    odd = rules.applicable(tenant="a:b{c}", subject="x y", tool="x", backend="y", quota_class=None)
    assert odd[0].key_suffix() == "tenant:a%3Ab%7Bc%7D"  # ids cannot break out of the key or its hash tag
    assert QuotaRules(tools={}, backends={}).applicable(tenant="a", subject="s", tool="t", backend="b",
                                                         quota_class=None) == ()


def test_the_registry_gives_tools_and_services_their_limits(tmp_path):
    assert spec_from_registry({"rate": 20, "per_s": 0.5, "burst": 2}) == LimitSpec(rate=20, period_ms=500, burst=2)
    config = load_config(env={}, overrides={"quotas.tenant": "rate=50/1s"})
    rules = build_rules(config, load_registry([DEMO_REGISTRY]))
    assert rules.tools["get_orders"].rate == 20 and rules.tools["get_user_preferences"].concurrency == 4
    assert rules.tenant is not None and rules.tenant.rate == 50
    bad = tmp_path / "bad.yaml"
    bad.write_text("services: {demo: {quotas: {burst: 3}}}\ntools: []\n")
    with pytest.raises(RegistryError, match="services"):
        load_registry([bad])


def test_retry_after_is_whole_seconds_rounded_up():
    assert retry_after_header(ProxyError("rate_limited", "slow down", details={"retry_after_s": 0.2})) == {
        "Retry-After": "1"}
    assert retry_after_header(ProxyError("rate_limited", "slow down", details={"retry_after_s": 2.01})) == {
        "Retry-After": "3"}
    assert retry_after_header(ProxyError("forbidden", "no", details={"retry_after_s": 2})) == {}
    assert retry_after_header(None) == {}
