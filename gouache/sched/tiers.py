"""Service tiers and tenants as the scheduler sees them: who goes first when the pool is full.

A request's tier is OpenAI's `service_tier` (`priority`, `default`, `flex`), kept on its
`RequestState` as a rank (0 is served first). Every policy is given the waiting requests in
`queue_order`: by tier, then by start-time fair queuing among the tenants of that tier
(`FairQueue`: each tenant gets its weight's share of the tier's work), then by arrival. It is
given the running ones by tier, then admission. A step policy fills its batch with
`make_room`. A running request of a lower tier then gives up its slot at a step boundary to a
waiting one of a higher tier. It is paused, its latents kept where they are, and it resumes
with the same result: a request's sampler and generator are its own, so the steps it runs do
not depend on when they run.

Plain values only: the simulator drives the same code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gouache.config import DEFAULT_QUEUE_SHARES
from gouache.request import RequestState

# The tenant weights served (`gouache.api.tenants` refuses a keys file with others). A request's
# work (steps x megapixels) is about 1e3 at most (200 steps of 2048 px), so at the smallest
# weight a fair-queue tag grows about 1e9 a request: finite for longer than any server runs; and
# `tenant_limit`'s limit x weight stays finite (a weight of 1e308 made it inf: an OverflowError).
MIN_WEIGHT, MAX_WEIGHT = 1e-6, 1e6


def work(state: RequestState) -> float:
    """What a request costs its tenant's share: its steps times its megapixels (of every frame)."""
    return state.num_steps * state.pixels / 1e6


@dataclass
class FairQueue:
    """Start-time fair queuing (Goyal et al., SFQ) among tenants, one virtual clock per tier.

    At arrival a request gets a start tag: the later of its tier's virtual time and where its
    tenant's previous request of that tier ends; it ends at start + work / weight. The tier's
    virtual time is the start tag of the request admitted last. Served in start-tag order, two
    tenants that both keep requests waiting get the tier's work in proportion to their weights,
    and a tenant that was idle starts at the present, with no credit saved up."""

    clock: dict[int, float] = field(default_factory=dict)  # tier -> virtual time
    ends: dict[tuple[int, str], float] = field(default_factory=dict)  # (tier, tenant) -> last finish tag

    def tag(self, state: RequestState) -> None:
        """Set the state's start tag (`fair_tag`) on its arrival."""
        key = (state.tier, state.tenant)
        start = max(self.clock.get(state.tier, 0.0), self.ends.get(key, 0.0))
        state.fair_tag = start
        self.ends[key] = start + work(state) / state.weight

    def admitted(self, state: RequestState) -> None:
        """A request of the tier starts (or resumes): the tier's virtual time moves to its tag."""
        self.clock[state.tier] = max(self.clock.get(state.tier, 0.0), state.fair_tag)


def queue_limit(tier: str, max_in_flight: int, shares: tuple[tuple[str, float], ...] = DEFAULT_QUEUE_SHARES) -> int:
    """How many requests of `tier` or a higher one a server holds before it refuses (429) one
    more of `tier`: the tier's share of its queue limit (flex: half, by default, so it is
    refused first). A lower tier's requests never keep a higher tier out."""
    return max(1, int(max_in_flight * dict(shares).get(tier, 1.0)))


def tenant_limit(tenant: str, weight: float, limit: int, active: dict[str, float]) -> int:
    """How many of a tier's `limit` places in the queue `tenant` may hold while the tenants in
    `active` (name -> weight: those with requests of the tier in flight) hold some: its weight's
    share, at least one; alone, all of them. The queue's places then go to the tenants as the
    fair queue serves them, so a tenant that sends more than the others cannot take their
    places, and over capacity each tenant's throughput follows its weight (not its arrivals)."""
    weights = {**active, tenant: weight}
    # finite for weights in [MIN_WEIGHT, MAX_WEIGHT] and a limit up to config.MAX_QUEUE_LEN (1e12
    # at most), and exact where the share is a whole number of places (limit x (weight / sum) is not)
    return max(1, int(limit * weight / sum(weights.values())))


@dataclass(frozen=True)
class Refusal:
    """Why an arrival is refused (429): `held` images count against `limit`, its tier's and the
    higher ones' (`queue_limit`), or, where `others` tenants share its tier, its tenant's share."""

    held: int
    limit: int
    tenant_share: bool = False
    others: int = 0


def refusal(tier: int, tenant: str, weight: float, count: int, in_flight: Iterable[tuple[int, str, float]],
            limit: int) -> Refusal | None:
    """Whether `count` images of `tier` (a rank) from `tenant` fit beside those `in_flight`
    ((tier rank, tenant, weight) each, waiting or running), `limit` being the tier's
    `queue_limit`: the engine's admission and the simulator's. None: they fit."""
    ahead = held = 0
    active: dict[str, float] = {}
    for rank, name, share in in_flight:
        ahead += rank <= tier
        if rank == tier:
            active[name] = share
            held += name == tenant
    if ahead + count > limit:
        return Refusal(ahead, limit)
    mine = tenant_limit(tenant, weight, limit, active)
    if held + count > mine:
        return Refusal(held, mine, tenant_share=True, others=len(active) - (tenant in active))
    return None


def queue_order(state: RequestState) -> tuple[int, float, float]:
    """The sort key of the waiting requests every policy is given."""
    return state.tier, state.fair_tag, state.arrival_time


def make_room(waiting: Sequence[RequestState], running: Sequence[RequestState],
              capacity: int) -> tuple[list[RequestState], list[RequestState], list[str]]:
    """(running kept, waiting admitted, running paused): the `capacity` first requests by tier,
    a running one before a waiting one of the same tier. So a request is paused only for a
    waiting request of a higher tier, and a full batch of one tier never churns. `waiting`
    comes in `queue_order`, `running` by tier. In tier order, no waiting request past the first
    `capacity` can be among the first `capacity` of all, so only those are ranked."""
    head = waiting[:capacity]
    ranked = sorted([*((s.tier, 0, i, s) for i, s in enumerate(running)),
                     *((s.tier, 1, i, s) for i, s in enumerate(head))], key=lambda entry: entry[:3])
    chosen = {id(entry[3]) for entry in ranked[:capacity]}
    return ([s for s in running if id(s) in chosen], [s for s in head if id(s) in chosen],
            [s.request_id for s in running if id(s) not in chosen])
