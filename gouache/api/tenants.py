"""Tenants: the API keys a server takes, each with a name, the service tiers it may use, a
request rate, a concurrency limit and a weight (its share of a tier among the tenants that
wait in it: `gouache.sched.tiers.FairQueue`).

`--api-keys FILE` holds them, reloaded on SIGHUP (a file that no longer reads keeps the keys
it replaced, and says why in the log):

    {"keys": [{"key": "...", "name": "alpha", "tiers": ["priority", "default", "flex"],
               "rate_per_s": 50, "max_concurrent": 64, "weight": 1}]}

`tiers` (default: all), `rate_per_s` and `max_concurrent` (default: no limit) and `weight`
(default 1) may be left out. Each number must lie in the range the server serves, and a file
with one outside it is refused naming the entry and field (at start; on SIGHUP the old keys stay):

- `weight` in [1e-6, 1e6] (`gouache.sched.tiers.MIN_WEIGHT`, `MAX_WEIGHT`): a tenant's share
  (`tenant_limit`) and its fair-queue tags (`FairQueue`: a request's work over its weight) stay
  finite (a weight of 1e308 made the share inf, a 500);
- `rate_per_s` in [1e-6, 1e9] requests per second: a refused request's Retry-After, a token's
  wait (1 - tokens) / rate, is at most 1e6 s (about 12 days), and 1e9/s is past any server's rate;
- `max_concurrent` an integer in [1, 1000000]: more requests in flight than any server holds.

A key's default tier (`service_tier` absent or `auto`) is `default` if it may use it, else the
first it lists. The single `--api-key` is one tenant named `default` with every tier and no
limits; a server without keys serves everyone as the tenant "". Over its rate or concurrency a
tenant gets 429 with Retry-After; a tier it may not use is a 403 naming the tier.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gouache.errors import TenantLimitError, TierForbiddenError
from gouache.request import DEFAULT_TIER, TIERS
from gouache.sched.tiers import MAX_WEIGHT, MIN_WEIGHT

log = logging.getLogger(__name__)

_FIELDS = {"key", "name", "tiers", "rate_per_s", "max_concurrent", "weight"}
# a rate limit's token bucket holds a second of its rate, at least this many requests: a client
# that keeps to its rate on average (Poisson arrivals) is not refused for bunching a little
MIN_BURST = 4.0
# The rates a tenant may have, requests per second. The slowest keeps a refused request's
# Retry-After ((1 - tokens) / rate, at most 1 / rate) a finite number of seconds an HTTP header
# holds; the fastest is past what any server serves, so a larger one is a typo.
MIN_RATE_PER_S, MAX_RATE_PER_S = 1e-6, 1e9
# The most API requests a tenant may have in flight: more than any server holds at once.
MAX_CONCURRENT = 1_000_000


@dataclass(frozen=True)
class Tenant:
    key: str
    name: str
    tiers: tuple[str, ...] = TIERS
    rate_per_s: float | None = None  # API requests per second (a burst of a second's worth, at least MIN_BURST)
    max_concurrent: int | None = None  # API requests in flight at once
    weight: float = 1.0

    @property
    def default_tier(self) -> str:
        return DEFAULT_TIER if DEFAULT_TIER in self.tiers else self.tiers[0]

    def tier(self, asked: str | None) -> str:
        """The tier a request of this tenant runs in (`auto` or none: its default); 403 if it may not use it."""
        tier = self.default_tier if asked in (None, "auto") else asked
        if tier not in self.tiers:
            who = f"the API key of '{self.name}'" if self.name else "this API key"
            raise TierForbiddenError(f"Invalid value for 'service_tier': {who} may not use the '{tier}' tier; "
                                     f"it may use {', '.join(self.tiers)}.", "service_tier")
        return tier


ANONYMOUS = Tenant(key="", name="")


def parse_tenants(text: str, source: str = "the API keys file") -> tuple[Tenant, ...]:
    """The tenants of a keys file's text; ValueError saying which entry and field is wrong."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:  # nested past Python's stack: not a keys file either
        raise ValueError(f"{source} is not JSON: {error}") from None
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f'{source} must be {{"keys": [{{"key": ..., "name": ...}}, ...]}} with at least one key')
    tenants = [_tenant(entry, f"{source}, keys[{i}]") for i, entry in enumerate(entries)]
    for what in ("key", "name"):
        values = [getattr(t, what) for t in tenants]
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            shown = repeated if what == "name" else ["(a key)"]
            raise ValueError(f"{source}: each {what} must be unique; repeated: {', '.join(shown)}")
    return tuple(tenants)


def _tenant(entry, where: str) -> Tenant:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object")
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise ValueError(f"{where} has unknown fields {', '.join(unknown)}; "
                         f"the fields are {', '.join(sorted(_FIELDS))}")
    for name in ("key", "name"):
        if not isinstance(entry.get(name), str) or not entry[name].strip():
            raise ValueError(f"{where}.{name} must be a non-empty string")
    tiers = entry.get("tiers", list(TIERS))
    if not isinstance(tiers, list) or not tiers or any(t not in TIERS for t in tiers):
        raise ValueError(f"{where}.tiers must be a non-empty list of {', '.join(TIERS)}")
    rate, concurrent, weight = entry.get("rate_per_s"), entry.get("max_concurrent"), entry.get("weight", 1)
    if rate is not None and not (_number(rate) and MIN_RATE_PER_S <= rate <= MAX_RATE_PER_S):
        raise ValueError(f"{where}.rate_per_s must be a number of requests per second in [{MIN_RATE_PER_S:g}, "
                         f"{MAX_RATE_PER_S:g}] (leave it out for no limit); got {_shown(rate)}")
    if concurrent is not None and not (_integer(concurrent) and 1 <= concurrent <= MAX_CONCURRENT):
        raise ValueError(f"{where}.max_concurrent must be an integer in [1, {MAX_CONCURRENT}] (leave it out for no "
                         f"limit); got {_shown(concurrent)}")
    if not (_number(weight) and MIN_WEIGHT <= weight <= MAX_WEIGHT):
        raise ValueError(f"{where}.weight must be a number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}] (default 1); "
                         f"got {_shown(weight)}")
    return Tenant(entry["key"], entry["name"], tuple(dict.fromkeys(tiers)), None if rate is None else float(rate),
                  concurrent, float(weight))


def _number(value) -> bool:
    # JSON numbers only (not true/false). The range checks compare exactly, so an integer too
    # large for a float (10**400) is refused, not an OverflowError, and NaN fails every bound.
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value) -> str:
    """A refused value as the message names it, short even for a 400-digit integer."""
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} characters)"


@dataclass
class _Usage:
    """One tenant's token bucket and requests in flight (kept by name across reloads)."""

    tokens: float = math.inf
    at: float = field(default_factory=time.monotonic)
    inflight: int = 0


class TenantBook:
    """The server's tenants, their limits and what they use now."""

    def __init__(self, tenants: tuple[Tenant, ...] = (), path: str | None = None):
        self.path = path
        self._tenants = tenants
        self._usage: dict[str, _Usage] = {}
        self._lock = threading.Lock()

    @classmethod
    def of(cls, api_key: str | None, path: str | None) -> TenantBook:
        """A keys file's tenants, else the single key's (tenant `default`), else none (open)."""
        if path is not None:
            return cls(parse_tenants(Path(path).read_text(), path), path)
        return cls((Tenant(api_key, "default"),) if api_key is not None else ())

    @property
    def open(self) -> bool:
        """No key is required: everyone is the anonymous tenant."""
        return not self._tenants

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self._tenants)

    def named(self, name: str) -> Tenant | None:
        return next((t for t in self._tenants if t.name == name), None)

    def reload(self) -> bool:
        """Read the keys file again (SIGHUP); on an error keep the tenants it had."""
        if self.path is None:
            return False
        try:
            tenants = parse_tenants(Path(self.path).read_text(), self.path)
        except (OSError, ValueError) as error:
            log.error("kept the API keys it had: %s", error)
            return False
        self._tenants = tenants
        log.info("API keys reloaded from %s: %d tenants (%s)", self.path, len(tenants), ", ".join(self.names))
        return True

    def authenticate(self, authorization: bytes | None) -> Tenant | None:
        """The tenant whose `Bearer KEY` header this is (compared in constant time against every
        key), the anonymous tenant on an open server; None otherwise."""
        if self.open:
            return ANONYMOUS
        found = None
        for tenant in self._tenants:
            if authorization is not None and hmac.compare_digest(authorization, f"Bearer {tenant.key}".encode()):
                found = tenant
        return found

    def acquire(self, tenant: Tenant, now: float | None = None) -> None:
        """Take one of the tenant's request slots and a token of its rate; 429 if it has none."""
        now = time.monotonic() if now is None else now
        with self._lock:
            usage = self._usage.setdefault(tenant.name, _Usage(at=now))
            if tenant.max_concurrent is not None and usage.inflight >= tenant.max_concurrent:
                raise TenantLimitError(f"'{tenant.name}' has {usage.inflight} requests in flight, its limit "
                                       f"(max_concurrent {tenant.max_concurrent}); retry when one ends")
            if tenant.rate_per_s is not None:
                burst = max(MIN_BURST, tenant.rate_per_s)
                usage.tokens = min(burst, usage.tokens + (now - usage.at) * tenant.rate_per_s)
                usage.at = now
                if usage.tokens < 1:  # tokens >= 0 here, so wait <= 1 / MIN_RATE_PER_S: a finite Retry-After
                    wait = (1 - usage.tokens) / tenant.rate_per_s
                    raise TenantLimitError(f"'{tenant.name}' is over its rate ({tenant.rate_per_s:g} requests/s); "
                                           f"retry in {wait:.2f} s", max(1, math.ceil(wait)))
                usage.tokens -= 1
            usage.inflight += 1

    def release(self, tenant: Tenant) -> None:
        """A request of the tenant ended: its slot is free."""
        with self._lock:
            usage = self._usage.get(tenant.name)
            if usage is not None and usage.inflight > 0:
                usage.inflight -= 1

    def inflight(self, name: str) -> int:
        with self._lock:
            usage = self._usage.get(name)
            return 0 if usage is None else usage.inflight
