"""Tenants (`--api-keys FILE`): each key's name, tiers, rate, concurrency and weight reach the
requests it sends; a tier it may not use is a 403, its limits a 429 with Retry-After that no
other tenant sees; the file is checked whole and reloaded on SIGHUP."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re

import httpx
import pytest

from gouache.api.server import create_app
from gouache.api.tenants import (
    ANONYMOUS,
    MAX_CONCURRENT,
    MAX_RATE_PER_S,
    MIN_RATE_PER_S,
    Tenant,
    TenantBook,
    parse_tenants,
)
from gouache.config import ServerConfig
from gouache.errors import TenantLimitError, TierForbiddenError
from tests.api.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
KEYS = {"keys": [
    {"key": "sk-alpha", "name": "alpha", "tiers": ["priority", "default", "flex"], "weight": 2},
    {"key": "sk-beta", "name": "beta", "tiers": ["flex", "default"], "max_concurrent": 1},
    {"key": "sk-gamma", "name": "gamma", "tiers": ["flex"], "rate_per_s": 1},
]}


def write(tmp_path, data) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("data, why", [
    ({"keys": []}, "with at least one key"),
    ([{"key": "k", "name": "n"}], "with at least one key"),
    ({"keys": [{"key": "k"}]}, "keys[0].name must be a non-empty string"),
    ({"keys": [{"key": "k", "name": "n", "tiers": ["gold"]}]}, "keys[0].tiers must be a non-empty list"),
    ({"keys": [{"key": "k", "name": "n", "rate_per_s": 0}]},
     "keys[0].rate_per_s must be a number of requests per second in [1e-06, 1e+09]"),
    ({"keys": [{"key": "k", "name": "n", "max_concurrent": 0}]},
     "keys[0].max_concurrent must be an integer in [1, 1000000]"),
    ({"keys": [{"key": "k", "name": "n", "weight": -1}]}, "keys[0].weight must be a number in [1e-06, 1e+06]"),
    ({"keys": [{"key": "k", "name": "n", "limit": 3}]}, "keys[0] has unknown fields limit"),
    ({"keys": [{"key": "k", "name": "n"}, {"key": "k2", "name": "n"}]}, "each name must be unique; repeated: n"),
    ({"keys": [{"key": "k", "name": "a"}, {"key": "k", "name": "b"}]}, "each key must be unique"),
])
def test_a_keys_file_is_checked_whole_and_says_what_to_fix(data, why):
    with pytest.raises(ValueError, match="keys file") as error:
        parse_tenants(json.dumps(data), "the keys file")
    assert why in str(error.value)


# Every number a JSON file can hold that a limit must not take: the extremes of a float (5e-324,
# 1e308, -1e308), NaN and the infinities (Python's json reads NaN, Infinity and 1e400), -0.0, an
# integer no float holds, and just past each end of each range.
OUT_OF_RANGE = {
    "weight": [1e308, -1e308, 5e-324, 0.0, -0.0, math.nan, math.inf, -math.inf, 10**400, 9.99e-7, 1.000001e6, True],
    "rate_per_s": [1e-310, 5e-324, 1e308, -1e308, -0.0, math.nan, math.inf, -math.inf, 10**400, 9.99e-7, 1.01e9],
    "max_concurrent": [0, -1, MAX_CONCURRENT + 1, 10**400, 1e308, 2.0, math.nan, math.inf, -0.0, True],
}


@pytest.mark.parametrize("field, value", [(f, v) for f, values in OUT_OF_RANGE.items() for v in values],
                         ids=lambda v: str(v)[:16])
def test_a_limit_outside_the_range_the_server_serves_is_refused_naming_its_entry(field, value):
    data = {"keys": [{"key": "k0", "name": "a"}, {"key": "k1", "name": "b", field: value}]}
    with pytest.raises(ValueError, match=rf"the keys file, keys\[1\]\.{field} must be .* in \[.*\]"):
        parse_tenants(json.dumps(data), "the keys file")


@pytest.mark.parametrize("field, value", [("weight", 1e308), ("rate_per_s", 1e-310)])
def test_a_server_refuses_at_start_the_limits_whose_requests_answered_500(engine: FakeEngine, config: ServerConfig,
                                                                         tmp_path, field, value):
    keys = {"keys": [{"key": "sk-a", "name": "a"}, {"key": "sk-b", "name": "b", field: value}]}
    config = dataclasses.replace(config, api_keys_file=write(tmp_path, keys))
    with pytest.raises(ValueError, match=rf"keys\[1\]\.{field} must be .*; got {re.escape(repr(value))}"):
        create_app(engine, config)


def test_a_tenant_at_the_ends_of_the_ranges_is_served_and_limited_with_a_finite_retry_after():
    data = {"keys": [{"key": "k-slow", "name": "slow", "rate_per_s": MIN_RATE_PER_S, "weight": 1e-6},
                     {"key": "k-fast", "name": "fast", "rate_per_s": MAX_RATE_PER_S, "weight": 1e6,
                      "max_concurrent": MAX_CONCURRENT}]}
    slow, fast = parse_tenants(json.dumps(data))
    book = TenantBook((slow, fast))
    for _ in range(4):  # its burst
        book.acquire(slow, now=0.0)
    with pytest.raises(TenantLimitError) as limited:
        book.acquire(slow, now=0.5)
    retry = limited.value.retry_after_s
    assert isinstance(retry, int) and retry == math.ceil((1 - 0.5 * MIN_RATE_PER_S) / MIN_RATE_PER_S)
    for now in (0.0, 1e12, 1e12):  # a clock far ahead refills the fastest bucket to its burst, no further
        book.acquire(fast, now=now)
    assert book.inflight("fast") == 3


def test_the_book_authenticates_limits_and_frees_per_tenant():
    alpha, beta, gamma = parse_tenants(json.dumps(KEYS))
    book = TenantBook((alpha, beta, gamma))
    assert book.authenticate(b"Bearer sk-beta") is beta and book.authenticate(b"Bearer sk-x") is None
    assert book.authenticate(None) is None and TenantBook().authenticate(None) is ANONYMOUS
    assert (alpha.weight, beta.default_tier, gamma.default_tier) == (2.0, "default", "flex")
    with pytest.raises(TierForbiddenError, match="'beta' may not use the 'priority' tier; it may use flex, default"):
        beta.tier("priority")
    book.acquire(beta)
    with pytest.raises(TenantLimitError, match="'beta' has 1 requests in flight"):
        book.acquire(beta)
    book.acquire(alpha)  # another tenant does not notice
    book.release(beta)
    book.acquire(beta)
    for _ in range(4):  # a burst of 4 (MIN_BURST) at once
        book.acquire(gamma, now=100.0)
    with pytest.raises(TenantLimitError) as limited:
        book.acquire(gamma, now=100.25)
    assert limited.value.retry_after_s == 1 and "over its rate (1 requests/s)" in limited.value.message
    book.acquire(gamma, now=101.3)  # a second later a token is back
    with pytest.raises(TenantLimitError):
        book.acquire(gamma, now=101.4)


def client_of(engine: FakeEngine, config: ServerConfig) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(create_app(engine, config), raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://testserver")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_each_key_is_its_tenant_with_its_tiers_and_limits(engine: FakeEngine, config: ServerConfig, tmp_path):
    config = dataclasses.replace(config, api_keys_file=write(tmp_path, KEYS))
    body = {"prompt": "a fox", "size": "64x64"}
    async with client_of(engine, config) as client:
        alpha = await client.post("/v1/images/generations", headers=auth("sk-alpha"),
                                  json={**body, "service_tier": "priority"})
        beta = await client.post("/v1/images/generations", headers=auth("sk-beta"),
                                 json={**body, "service_tier": "auto"})
        forbidden = await client.post("/v1/images/generations", headers=auth("sk-beta"),
                                      json={**body, "service_tier": "priority"})
        unknown = await client.post("/v1/images/generations", headers=auth("sk-delta"), json=body)
        engine.hold = True  # beta's next request stays in flight: its second is over its concurrency
        held = asyncio.ensure_future(client.post("/v1/images/generations", headers=auth("sk-beta"), json=body))
        while engine.running == 0:
            await asyncio.sleep(0.005)
        over = await client.post("/v1/images/generations", headers=auth("sk-beta"), json=body)
        other = asyncio.ensure_future(client.post("/v1/images/generations", headers=auth("sk-alpha"), json=body))
        while engine.running < 2:
            await asyncio.sleep(0.005)
        engine.hold = False
        await held, await other
        metrics = (await client.get("/metrics", headers=auth("sk-alpha"))).text
    assert alpha.status_code == beta.status_code == 200
    assert [(r.tenant, r.tier.label, r.tenant_weight) for r in engine.submitted[:2]] == [
        ("alpha", "priority", 2.0), ("beta", "default", 1.0)]
    assert forbidden.status_code == 403 and forbidden.json()["error"]["param"] == "service_tier"
    assert unknown.status_code == 401
    assert over.status_code == 429 and over.headers["retry-after"] == "1" and "max_concurrent 1" in over.text
    assert (await held).status_code == 200 and (await other).status_code == 200  # alpha never noticed
    assert 'gouache_tenant_requests_total{result="limited",tenant="beta",tier="default"} 1.0' in metrics
    assert 'gouache_tenant_requests_total{result="accepted",tenant="alpha",tier="priority"} 1.0' in metrics
    assert 'gouache_tier_latency_seconds_count{tier="priority"} 1.0' in metrics
    assert 'gouache_tier_latency_seconds_count{tier="default"} 3.0' in metrics  # beta's two, alpha's other


def test_sighup_reload_takes_a_new_file_and_keeps_the_old_on_an_error(tmp_path):
    path = write(tmp_path, KEYS)
    book = TenantBook.of(None, path)
    assert book.names == ("alpha", "beta", "gamma")
    write(tmp_path, {"keys": [{"key": "sk-new", "name": "new"}]})
    assert book.reload() and book.authenticate(b"Bearer sk-new").name == "new"
    assert book.authenticate(b"Bearer sk-alpha") is None
    (tmp_path / "keys.json").write_text("{not json")
    assert not book.reload() and book.names == ("new",)
    for bad in ('{"keys": [{"key": "k", "name": "heavy", "weight": 1e308}]}',
                '{"keys": [{"key": "k", "name": "slow", "rate_per_s": 1e-310}]}',
                '{"keys": [{"key": "k", "name": "huge", "max_concurrent": 1%s}]}' % ("0" * 400),
                '{"keys": [{"key": "k", "name": "nan", "weight": NaN}]}', '{"keys": ' + "[" * 100_000):
        (tmp_path / "keys.json").write_text(bad)
        assert not book.reload() and book.names == ("new",)


def test_one_key_or_a_keys_file_not_both():
    with pytest.raises(ValueError, match="not both"):
        ServerConfig(api_key="k", api_keys_file="keys.json")
    assert TenantBook.of("k", None).authenticate(b"Bearer k") == Tenant("k", "default")


async def test_a_tenant_at_the_slowest_rate_gets_429_with_a_finite_retry_after(engine: FakeEngine,
                                                                               config: ServerConfig, tmp_path):
    keys = {"keys": [{"key": "sk-slow", "name": "slow", "rate_per_s": MIN_RATE_PER_S, "weight": 1e-6}]}
    config = dataclasses.replace(config, api_keys_file=write(tmp_path, keys))
    body = {"prompt": "a fox", "size": "64x64"}
    async with client_of(engine, config) as client:
        answers = [await client.post("/v1/images/generations", headers=auth("sk-slow"), json=body) for _ in range(5)]
    assert [a.status_code for a in answers] == [200] * 4 + [429]  # its burst of 4, then over its rate
    retry = answers[-1].headers["retry-after"]
    assert retry.isdigit() and 1 <= int(retry) <= math.ceil(1 / MIN_RATE_PER_S)
