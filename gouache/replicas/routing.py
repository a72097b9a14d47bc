"""What the front's router sees of its replicas: the router, what a request costs it, and each
replica's load.

Each image of a request is waiting until its first step and running after it, with its steps
still to run, until its image or its error. Edits that replay a template get their repaint ratio
measured when the router reads it (least-tokens, mask-aware); other edits compute every token
and count as whole images. With `--template-cost-model` the mask-aware router prices steps with
that measured model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gouache.engine.imaging import repaint_ratio
from gouache.sched.router import ROUTERS, BatchStepCost, MeasuredEditCost, ReplicaLoad, Router, RouteRequest
from gouache.sim.costs import linear_step_cost

if TYPE_CHECKING:
    import zmq.asyncio

    from gouache.config import TemplateConfig
    from gouache.engine.handle import RequestHandle
    from gouache.model_info import ModelInfo
    from gouache.request import ImageRequest

# The mask-aware router's step cost without `--template-cost-model`: the simulator's linear
# stand-in (20 ms a forward, 80 ms a megapixel, an edit counting its repainted pixels). Routing
# only compares replicas, so the shape matters, not the scale.
ROUTER_STEP_COST = linear_step_cost(per_forward_s=0.020, per_megapixel_s=0.080)


def make_router(name: str, step_cost: BatchStepCost = ROUTER_STEP_COST.batch_step_time) -> Router:
    """The router `name`; mask-aware prices a batch's step with `step_cost`."""
    if name not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(sorted(ROUTERS))}, got {name!r}")
    return ROUTERS[name](step_cost) if name == "mask-aware" else ROUTERS[name]()


def route_step_cost(templates: TemplateConfig, info: ModelInfo) -> BatchStepCost:
    """What the mask-aware router prices a step with: the measured template-edit model of
    `--template-cost-model` (the one each replica's load plan runs on) for this model's tokens and
    rows, else the linear stand-in."""
    if templates.cost_model is None:
        return ROUTER_STEP_COST.batch_step_time
    from gouache.sched.costmodel import load_mask_model  # scikit-learn: a second to import, only here

    return MeasuredEditCost(load_mask_model(templates.cost_model), info.token_pixels,
                            info.cfg_rows(info.default_guidance))


def computed_share(request: ImageRequest, templates: TemplateConfig, max_pixels: int) -> float:
    """The share of an image's tokens its steps compute, as the router counts them: an edit that
    replays a template computes its mask (its repaint ratio); a generation, and an edit that does
    not replay (`template_cache` false, or absent under a server without `--template-cache`),
    compute every token, as diffusers' inpaint pipelines do."""
    replays = templates.default if request.template_cache is None else request.template_cache
    if not request.is_edit or not replays or request.register_template:
        return 1.0
    return repaint_ratio(request, max_pixels)


@dataclass
class SentRequest:
    """One API request sent to a replica, as the router sees it: one entry per image."""

    handle: RequestHandle
    images: dict[int, RouteRequest]  # image index -> its view; gone when the image is done
    started: set[int] = field(default_factory=set)  # images that have run a step


@dataclass
class ReplicaView:
    """One replica as the front keeps it: how to reach it, whether it serves, and the requests it
    holds, which make its load."""

    index: int
    process: Any  # a multiprocessing.Process, or a RayReplica under ray
    commands: zmq.asyncio.Socket
    alive: bool = True
    requests: dict[str, SentRequest] = field(default_factory=dict)  # by API id
    missed_pings: int = 0  # pings in a row it did not answer in time
    joining: bool = False  # under ray: a replacement not ready yet (not routed to, not pinged)
    nodes: list[str] = field(default_factory=list)  # under ray: each device's Ray node id, the replica's own first

    def load(self, max_batch: int) -> ReplicaLoad:
        load = ReplicaLoad(max_batch=max_batch)
        for request in self.requests.values():
            for index, view in request.images.items():
                (load.running if index in request.started else load.waiting).append(view)
        return load
