"""Service tiers in the simulator: the live policies' tier order, pauses and fair share on a
simulated clock, the engine's tiered queue limit (`Admission`), per-tier metrics, and the
2x-overload experiment at a size a test can run."""

import json

import pytest

from gouache.config import SchedulerConfig
from gouache.sched.policies import make_policy
from gouache.sim.costs import LinearStepCost
from gouache.sim.exp_tiers import TiersSetup, tiers_experiment
from gouache.sim.simulator import Admission, simulate
from gouache.sim.workloads import SimRequest, read_trace, tiered_trace, write_trace

TIERS_20_60_20 = {"priority": 0.2, "default": 0.6, "flex": 0.2}
TENANTS_50_30_20 = {"alpha": 0.5, "beta": 0.3, "gamma": 0.2}
COST = LinearStepCost(per_megapixel_s=1.0, per_forward_s=0.0)  # 1 s a step of a 1 MP image


def request(rid, arrival, tier, steps=4, tenant="", weight=1.0, slo_s=None):
    return SimRequest(rid, arrival, 1000, 1000, steps, slo_s, tier=tier, tenant=tenant, weight=weight)


def test_a_priority_arrival_pauses_a_flex_request_and_both_finish():
    policy = make_policy(SchedulerConfig(policy="orca", max_batch_size=1))
    result = simulate([request("flex", 0.0, "flex"), request("priority", 1.5, "priority", steps=2)], policy, COST)
    records = {r.request.request_id: r for r in result.records}
    # flex steps at 0-1 and 1-2; priority waits for that step, runs 2-4; flex resumes 4-6
    assert (records["priority"].first_step, records["priority"].finish) == (2.0, 4.0)
    assert (records["flex"].finish, records["flex"].pauses, records["priority"].pauses) == (6.0, 1, 0)
    assert result.metrics("priority").latency_p50_s == 2.5 and result.metrics("flex").num_requests == 1


def test_tenants_of_a_tier_finish_by_weight():
    """Two tenants keep one device busy with equal requests; weight 2 gets twice the turns."""
    policy = make_policy(SchedulerConfig(policy="orca", max_batch_size=1))
    trace = [request(f"{t}{i}", 0.0, "default", steps=1, tenant=t, weight=w)
             for t, w in (("heavy", 2.0), ("light", 1.0)) for i in range(12)]
    result = simulate(trace, policy, COST)
    first = sorted((r for r in result.records), key=lambda r: r.finish)[:9]
    assert sum(r.request.tenant == "heavy" for r in first) == 6


def test_admission_refuses_flex_first_and_never_a_higher_tier_for_a_lower_ones_queue():
    admission = Admission(max_in_flight=4, shares=(("flex", 0.5),))
    policy = make_policy(SchedulerConfig(policy="orca", max_batch_size=1))
    trace = [request(f"f{i}", 0.0, "flex", steps=10) for i in range(3)]
    trace += [request(f"d{i}", 0.0, "default", steps=10) for i in range(5)]
    trace += [request("p0", 0.0, "priority", steps=1)]
    result = simulate(trace, policy, COST, admission=admission)
    refused = {r.request.request_id for r in result.records if r.refused_at is not None}
    assert refused == {"f2", "d4"}  # flex past 2 of its own; default past 4 of its own and priority's
    assert result.metrics().refused == 2 and result.metrics("priority").finished == 1


def test_over_capacity_tenants_of_equal_weight_get_equal_throughput_whatever_they_send():
    """One tenant sends three times what the other does, both over capacity: the queue's places
    go by weight (`tenant_limit`), so each finishes half of what the device does."""
    admission = Admission(max_in_flight=8)
    policy = make_policy(SchedulerConfig(policy="orca", max_batch_size=2))
    trace = [request(f"{t}{i}", i * gap, "default", steps=2, tenant=t)
             for t, gap in (("loud", 0.25), ("quiet", 0.75)) for i in range(int(120 / gap))]
    result = simulate(sorted(trace, key=lambda r: r.arrival), policy, COST, admission=admission)
    done = {t: sum(r.finish is not None and r.finish <= 120 and r.request.tenant == t for r in result.records)
            for t in ("loud", "quiet")}
    assert sum(done.values()) >= 55 and abs(done["loud"] - done["quiet"]) <= 0.1 * done["quiet"], done
    alone = simulate([r for r in trace if r.tenant == "loud"], policy, COST, admission=admission)
    loud_alone = sum(r.finish is not None and r.finish <= 120 for r in alone.records)
    assert loud_alone >= 55  # alone, its share is every place and every step


def test_a_trace_keeps_tiers_tenants_and_weights(tmp_path):
    trace = [request("a", 0.0, "priority", tenant="alpha", weight=2.0), request("b", 1.0, "flex")]
    for suffix in (".csv", ".jsonl"):
        write_trace(tmp_path / f"t{suffix}", trace)
        assert read_trace(tmp_path / f"t{suffix}") == trace
    with pytest.raises(ValueError, match="tier must be one of priority, default, flex"):
        request("c", 0.0, "gold")


def test_the_overload_experiment_serves_priority_first(tmp_path):
    data = tiers_experiment(tmp_path, TiersSetup(devices=4, duration_s=60))
    rows = {(row["run"], row["tier"]): row for row in data["rows"]}
    assert rows["tiers", "priority"]["slo_attainment"] > rows["tier-blind", "priority"]["slo_attainment"] + 0.5
    assert rows["tiers", "priority"]["refused"] == 0 and rows["tiers", "flex"]["refused"] > 0
    assert rows["tiers", "flex"]["refused"] > rows["tier-blind", "flex"]["refused"]
    assert json.loads((tmp_path / "tiers.json").read_text())["requests"] == data["requests"]
    assert "| tiers | priority |" in (tmp_path / "tiers.md").read_text()


def test_a_trace_draws_tiers_and_tenants_in_their_shares_with_each_tiers_slo():
    slo = {"priority": 1.0, "default": 10.0, "flex": None}
    trace = tiered_trace(50.0, 100.0, [(256, 256), (384, 384)], 10, TIERS_20_60_20, TENANTS_50_30_20, slo, seed=0)
    assert 4500 < len(trace) < 5500 and trace == sorted(trace, key=lambda r: r.arrival)
    for tier, share in TIERS_20_60_20.items():
        mine = [r for r in trace if r.tier == tier]
        assert abs(len(mine) / len(trace) - share) < 0.03 and {r.slo_s for r in mine} == {slo[tier]}
    assert abs(sum(r.tenant == "alpha" for r in trace) / len(trace) - TENANTS_50_30_20["alpha"]) < 0.03
