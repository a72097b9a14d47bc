"""Replica choice for a new request: round-robin, least-requests, least-tokens, mask-aware.

A router sees each replica as a `ReplicaLoad` (plain values the replica reports) and returns
the index of the replica to send the request to. `mask-aware` is InstGenIE Algorithm 2
(§4.4): the cost of a replica is the predicted latency of the new request there, from the
per-step cost of the replica's batch with it (regression models + the cache load plan), times
its steps, plus the time the replica needs before a slot frees up.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gouache.sched.costmodel import MaskCostModel


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    pixels: int  # width x height of the image
    steps: int  # denoising steps still to run
    mask_ratio: float = 1.0  # fraction of tokens an edit recomputes; 1.0 for generation
    tier: int = 1  # its service tier's rank (`gouache.sched.tiers`): it waits only behind the ranks up to its own


@dataclass
class ReplicaLoad:
    """What the router knows about one replica."""

    running: list[RouteRequest] = field(default_factory=list)  # in the denoising batch
    waiting: list[RouteRequest] = field(default_factory=list)  # queued behind it
    max_batch: int = 8

    @property
    def requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def ahead_of(self, tier: int) -> int:
        """Requests of its tier or a higher one: those a request of `tier` shares the replica with
        (the lower tiers give way to it)."""
        return sum(r.tier <= tier for r in (*self.running, *self.waiting))

    def admitted(self) -> ReplicaLoad:
        """This replica once its next step begins: queued requests that fit the batch's free slots
        have joined it (continuous batching admits them at the next step)."""
        free = max(self.max_batch - len(self.running), 0)
        return ReplicaLoad(self.running + self.waiting[:free], self.waiting[free:], self.max_batch)

    @property
    def masked_pixels(self) -> float:
        """Pixels still to compute per step (an edit's masked ones only): the tokens, up to the
        model's pixels per token."""
        return sum(r.pixels * r.mask_ratio for r in (*self.running, *self.waiting))


class Router(ABC):
    name: str
    reads_masks = False  # whether it reads `RouteRequest.mask_ratio` (the API then measures each edit's)

    @abstractmethod
    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        """Index of the replica that gets `request`."""


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        return next(self._next) % len(replicas)


class LeastRequestsRouter(Router):
    """The replica with the fewest requests a new one would share it with: those of its service
    tier or a higher one (the lower tiers give way to it), then the fewest in all."""

    name = "least-requests"

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        return min(range(len(replicas)), key=lambda i: (replicas[i].ahead_of(request.tier), replicas[i].requests, i))


class LeastTokensRouter(Router):
    name = "least-tokens"
    reads_masks = True

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        return min(range(len(replicas)), key=lambda i: (replicas[i].masked_pixels, i))


BatchStepCost = Callable[[Sequence[RouteRequest]], float]  # seconds per step of a batch


@dataclass(frozen=True)
class MeasuredEditCost:
    """`BatchStepCost` from a measured mask-aware model (`gouache profile --edits`, the live
    server's `--template-cost-model`): a step of the batch is the model's pipelined step
    (`MaskCostModel.predict`, the longer of compute and cache loading) over its requests, each
    pixels / token_pixels² image tokens at its mask ratio (1 for a generation or an edit that
    computes every token), in `rows` forward rows (2 under classifier-free guidance)."""

    model: MaskCostModel
    token_pixels: int  # pixels per side of one image token (a DiT's patch, a UNet's latent pixel)
    rows: int = 1  # forward rows per request

    def __call__(self, batch: Sequence[RouteRequest]) -> float:
        edits = [(max(1, r.pixels // self.token_pixels**2), r.mask_ratio) for r in batch for _ in range(self.rows)]
        return self.model.predict(edits)


class MaskAwareRouter(Router):
    """InstGenIE Algorithm 2 with an injected batch step-cost model (see `costmodel`)."""

    name = "mask-aware"
    reads_masks = True

    def __init__(self, step_cost: BatchStepCost):
        self.step_cost = step_cost

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        return min(range(len(replicas)), key=lambda i: (self.cost(request, replicas[i]), i))

    def cost(self, request: RouteRequest, replica: ReplicaLoad) -> float:
        """Predicted seconds from now until `request` finishes on `replica`, once the replica's
        queue has taken the batch's free slots (`ReplicaLoad.admitted`): a request routed a moment
        ago waits for the next step, not for a slot (counting it as queued made a replica with
        free slots look as if a running request had to finish first; docs/routing.md)."""
        return self.latency(request, replica.admitted())

    def latency(self, request: RouteRequest, replica: ReplicaLoad) -> float:
        """`cost` on the replica as given. With a free slot and no queue the request joins the
        running batch at once and runs its steps at the step cost of the batch with it.
        Otherwise it needs the k-th slot to free up, k = the requests queued before it plus
        one: under continuous batching that is when the k-th shortest running request finishes
        (queued requests beyond the running ones each wait one more mean request length per
        batch width)."""
        running = replica.running[: replica.max_batch]
        if len(running) < replica.max_batch and not replica.waiting:
            return request.steps * self.step_cost([*running, request])
        if not running:  # queued work but an empty batch: it is admitted all at once
            return request.steps * self.step_cost([*replica.waiting[: replica.max_batch - 1], request])
        remaining = sorted(r.steps for r in running)
        k = len(replica.waiting) + 1
        if k <= len(remaining):
            wait_steps = remaining[k - 1]
        else:
            mean = sum(remaining) / len(remaining)
            wait_steps = remaining[-1] + (k - len(remaining)) * mean / replica.max_batch
        batch = [*running[1:], request]
        return wait_steps * self.step_cost(running) + request.steps * self.step_cost(batch)


ROUTERS: dict[str, Callable[..., Router]] = {
    cls.name: cls for cls in (RoundRobinRouter, LeastRequestsRouter, LeastTokensRouter, MaskAwareRouter)
}
