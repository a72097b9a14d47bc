"""Joining a Ray cluster and placing gouache's actors on its nodes (no torch: the API front uses it).

A replica's devices are one placement group: one bundle per device (`{"CPU": 1}`, or `{"GPU": 1}`
under CUDA, plus one unit of the `--ray-resource` custom resource if one is named). The
strategy is `--ray-placement`:

- `strict-pack` (the default): every bundle on one node, so that a replica's workers (and the
  replica's own actor, which runs in bundle 0) share a node and its collectives stay off the
  network. A replica that no live node could hold is refused at once, naming what each node has.
- `pack`: on as few nodes as have room, straddling nodes only when no single one has.
- `spread`: across nodes on purpose.

A custom resource keeps devices off the nodes that do not offer it: start the device nodes with
`ray start ... --resources '{"gouache": 8}'` and the API front's node without it. Ray needs a
resource to schedule by, and a node without it is never picked.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup


def require_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--executor ray needs Ray: pip install 'gouache[ray]'") from None
    return ray


def connect(address: str | None) -> bool:
    """Join Ray at `address` (None: start one here) unless this process already has; True if it
    started or joined now (and so should shut it down)."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    return True


def device_bundles(devices: int, cuda: bool, resource: str | None) -> list[dict[str, float]]:
    """One bundle per device: what each device's worker actor reserves."""
    return [{"GPU" if cuda else "CPU": 1.0, **({resource: 1.0} if resource else {})} for _ in range(devices)]


def worker_resources(cuda: bool, resource: str | None) -> dict[str, Any]:
    """`ray.remote`'s arguments for a worker actor that fills one of `device_bundles`."""
    return {"num_gpus" if cuda else "num_cpus": 1, **({"resources": {resource: 1}} if resource else {})}


def check_fits(bundles: list[dict[str, float]], placement: str, groups: int = 1) -> None:
    """Refuse `groups` placement groups of `bundles` that the live nodes, empty, could never hold
    at once: Ray would keep them pending until such nodes join, and a start would only time out."""
    ray = require_ray()
    nodes = [node for node in ray.nodes() if node["Alive"]]
    each, size = bundles[0], len(bundles)
    fits = [min(math.floor(node["Resources"].get(key, 0.0) / amount) for key, amount in each.items())
            for node in nodes]  # bundles each node could hold, empty
    room = sum(f // size for f in fits) if placement == "strict-pack" else sum(fits) // size
    if room >= groups:
        return
    what = f"{size} devices of {_resources(each, each)} each"
    if groups > 1:
        what = f"{groups} replicas of {what}"
    where = ("on one node" if groups == 1 else "with each replica's on one node") if placement == "strict-pack" \
        else "on the cluster's nodes"
    offered = "; ".join(f"{node_name(n['NodeID'])}: {_resources(n['Resources'], each)}" for n in nodes)
    hint = (" Add nodes with room, or let a replica's devices straddle nodes with --ray-placement pack."
            if placement == "strict-pack" else " Add nodes.")
    raise ValueError(f"{what} do not fit {where} (--ray-placement {placement}); the live nodes offer "
                     f"{offered or 'nothing'}.{hint}")


def reserve(bundles: list[dict[str, float]], placement: str, name: str) -> PlacementGroup:
    """Ask Ray for a placement group of `bundles` (granted later: see `wait_placed`)."""
    ray = require_ray()
    return ray.util.placement_group(bundles, strategy=placement.upper().replace("-", "_"), name=name)


def wait_placed(group: PlacementGroup, timeout_s: float, what: str) -> None:
    """Wait until Ray granted `group`; raise naming `what` and the free resources if it did not."""
    ray = require_ray()
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        raise RuntimeError(f"{what}: Ray did not grant its placement ({len(group.bundle_specs)} x "
                           f"{_resources(group.bundle_specs[0], group.bundle_specs[0])}) within {timeout_s:g} s; "
                           f"the cluster has free {_resources(ray.available_resources(), group.bundle_specs[0])}")


def release(group: PlacementGroup) -> None:
    """Give a placement group back (its actors, if any are left, are killed with it)."""
    require_ray().util.remove_placement_group(group)


def in_bundle(group: PlacementGroup, index: int) -> dict[str, Any]:
    """`.options()` that run an actor in bundle `index` of `group`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}


def bundle_nodes(group: PlacementGroup) -> list[str]:
    """The node id of each bundle of a granted group, in bundle order."""
    nodes = require_ray().util.placement_group_table(group)["bundles_to_node_id"]
    return [nodes[index] for index in sorted(nodes)]


def current_group() -> PlacementGroup | None:
    """The placement group this actor runs in (a replica placed by the front), None in a driver."""
    return require_ray().util.get_current_placement_group()


def this_node() -> str:
    return require_ray().get_runtime_context().get_node_id()


def node_lost(node_id: str) -> bool:
    """Whether the cluster took node `node_id` for dead (or never knew it)."""
    return not any(node["NodeID"] == node_id and node["Alive"] for node in require_ray().nodes())


def node_name(node_id: str) -> str:
    """"Ray node 3f2a9c1b (10.0.0.5)": the id's first 8 hex digits, as `ray list nodes` shows it in full."""
    address = next((n["NodeManagerAddress"] for n in require_ray().nodes() if n["NodeID"] == node_id), "?")
    return f"Ray node {node_id[:8]} ({address})"


def _resources(resources: dict[str, float], keys: dict[str, float]) -> str:
    """`resources` restricted to the names of `keys`, as "CPU 2, gouache 2"."""
    return ", ".join(f"{key} {resources.get(key, 0):g}" for key in keys)
