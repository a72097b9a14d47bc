"""The routing experiment's parts: heavy-tailed masks, a router's stale view, the report."""

import numpy as np
import pytest

from gouache.config import SchedulerConfig
from gouache.sched.policies import make_policy
from gouache.sched.router import LeastRequestsRouter
from gouache.sim.costs import linear_step_cost
from gouache.sim.exp_routing import ROUTERS, Setup, StaleViewSimulator, routing_experiment, trace
from gouache.sim.simulator import Simulator
from gouache.sim.workloads import SimRequest, mixed_masks, with_masks


def test_mixed_masks_keep_the_mean_with_a_share_of_whole_images():
    masks = mixed_masks(20000, 0.11, 0.05, np.random.default_rng(0))
    assert masks.mean() == pytest.approx(0.11, abs=0.005)
    assert (masks == 1.0).mean() == pytest.approx(0.05, abs=0.005)
    assert np.median(masks) < 0.07  # most masks are small
    with pytest.raises(ValueError, match="full_share < mean"):
        mixed_masks(10, 0.11, 0.2, np.random.default_rng(0))


def test_a_setup_that_changes_only_the_masks_keeps_the_arrivals():
    beta, heavy = (trace(Setup("masks", masks=m), 50, seed=3) for m in ("beta", "full-0.05"))
    assert [r.arrival for r in beta] == [r.arrival for r in heavy]
    assert [r.mask_ratio for r in beta] != [r.mask_ratio for r in heavy]
    assert with_masks(beta, [0.5] * 50)[7] == SimRequest("r7", beta[7].arrival, 1024, 1024, 28, mask_ratio=0.5)


def orca(n: int) -> list:
    return [make_policy(SchedulerConfig(policy="orca", max_batch_size=1)) for _ in range(n)]


def test_a_stale_view_keeps_finished_requests_and_adds_what_it_routed():
    # 1 s steps, one request per batch. a (3 steps) goes to 0, b (1 step) to 1 and ends at 1.0.
    # At 1.5 the fresh view sees a on 0 and nothing on 1: c goes to 1. The view of 0.0 still holds
    # b on 1 (and a, which it routed, on 0): a tie, broken by index, sends c to 0.
    cost = linear_step_cost(per_forward_s=1.0)
    requests = [SimRequest("a", 0.0, 64, 64, 3), SimRequest("b", 0.0, 64, 64, 1), SimRequest("c", 1.5, 64, 64, 1)]

    def replicas(every_s: float) -> list[int]:
        sim = (StaleViewSimulator(orca(2), cost, LeastRequestsRouter(), every_s=every_s) if every_s
               else Simulator(orca(2), cost, LeastRequestsRouter()))
        return [r.replica for r in sim.run(requests).records]

    assert replicas(0.0) == [0, 1, 1]
    assert replicas(1.0) == [0, 1, 1]  # it looks again at 1.5
    assert replicas(10.0) == [0, 1, 0]


def test_the_experiment_reports_every_router_per_setup(tmp_path):
    data = routing_experiment(tmp_path, ["view"], num_requests=40, seeds=(0,), workers=1)["view"]
    assert {r["router"] for r in data["runs"]} == set(ROUTERS)
    assert len(data["reductions"]) == 12 and all("vs least-requests" in r for r in data["reductions"])
    table = (tmp_path / "routing_view.md").read_text()
    assert table.startswith("# why") and "| masks | view_every_s | estimate | p95 round-robin |" in table
    with pytest.raises(ValueError, match="unknown hypotheses"):
        routing_experiment(tmp_path, ["nonsense"])


def test_assigned_tokens_balances_what_it_sent_whether_or_not_it_finished():
    from gouache.sched.router import ReplicaLoad, RouteRequest
    from gouache.sim.exp_routing import AssignedTokensRouter

    router, idle = AssignedTokensRouter(), [ReplicaLoad(), ReplicaLoad()]
    masks = (1.0, 0.2, 0.3, 0.4, 0.2, 0.1)
    sent = [router.route(RouteRequest(str(i), 100, 1, m), idle) for i, m in enumerate(masks)]
    assert sent == [0, 1, 1, 1, 1, 0]  # 1 has been sent 0.2 + 0.3 + 0.4 + 0.2 = 1.1 > 1.0 when 0.1 comes
