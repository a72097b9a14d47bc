"""`gouache bench tiers`' own arithmetic: its table counts each request's outcome in its tier."""

from gouache.bench.tiers import Outcome, tier_rows
from gouache.sim.workloads import tiered_trace


def test_the_table_counts_outcomes_and_slo_per_tier():
    trace = tiered_trace(10.0, 1.0, [(256, 256)], 10, {"priority": 1.0}, {"a": 1.0}, {"priority": 1.0}, seed=1)
    first, second, *rest = trace
    outcomes = {first.request_id: Outcome("finished", 0.5, 0.4), second.request_id: Outcome("finished", 2.0, 1.9)}
    outcomes.update({r.request_id: Outcome("refused") for r in rest})
    [row] = tier_rows("overload", trace, outcomes)
    assert (row["finished"], row["refused"], row["lost"]) == (2, len(rest), 0)
    assert row["slo_attainment"] == 1 / len(trace) and row["p50_s"] == 1.25


def test_planning_with_the_measured_scale_shortens_prioritys_tail_in_the_simulator():
    """The bench's simulation of its overload trace with steps 1.3x their prediction: planned
    with the cost model times that (as the calibrated engine plans), priority's p95 is shorter
    than planned with the cost model as profiled, which packs too much beside it."""
    import argparse

    from gouache.bench.tiers import TENANT_SHARES, TIER_SHARES, simulated_rows
    from gouache.sched.costmodel import load

    model = load("benchmarks/results/tiers/costmodel_tiny-sdxl_cpu.json")
    slo_s = {"priority": 0.93, "default": 6.2, "flex": None}
    trace = tiered_trace(4.0, 120.0, [(256, 256), (384, 384)], 10, TIER_SHARES, TENANT_SHARES, slo_s, seed=0)
    denoised = {r.request_id: 1.0 for r in trace}
    args = argparse.Namespace(max_batch_size=4, max_queue_len=16, calibrate_steps=True)
    tiers = (("priority", 930.0), ("default", 6200.0))
    p95 = {calibrated: next(row["sim_p95_s"] for row in simulated_rows(args, trace, model, 1.3, tiers, denoised,
                                                                       stages=False, calibrated=calibrated)
                            if row["tier"] == "priority")
           for calibrated in (True, False)}
    assert p95[True] < 0.9 * p95[False]


def test_steps_drawn_from_measured_ratios_vary_as_they_did():
    """One ratio drawn every time is the same simulation as that scale; ratios spread about
    the same mean lengthen priority's tail, which the mean alone cannot."""
    import argparse

    from gouache.bench.tiers import TENANT_SHARES, TIER_SHARES, simulated_rows
    from gouache.sched.costmodel import load

    model = load("benchmarks/results/tiers/costmodel_tiny-sdxl_cpu.json")
    trace = tiered_trace(4.0, 60.0, [(256, 256), (384, 384)], 10, TIER_SHARES, TENANT_SHARES,
                         {"priority": 0.93, "default": 6.2, "flex": None}, seed=0)
    denoised = {r.request_id: 1.0 for r in trace}
    args = argparse.Namespace(max_batch_size=4, max_queue_len=16, calibrate_steps=True)
    tiers = (("priority", 930.0), ("default", 6200.0))

    def p95(**kwargs):
        rows = simulated_rows(args, trace, model, 1.2, tiers, denoised, stages=False, **kwargs)
        return next(row["sim_p95_s"] for row in rows if row["tier"] == "priority")

    assert p95(ratios=[1.2] * 3) == p95()
    assert p95(ratios=[0.7, 0.7, 2.2]) > 1.05 * p95()


def test_sim_to_real_compares_each_tier_by_its_targets_numbers():
    """Priority and default by latency, flex by refusals: flex's latency gap does not count."""
    from gouache.bench.tiers import sim_to_real

    rows = [{"tier": "priority", "p50_gap": 0.01, "p95_gap": -0.08, "sim_refused": 0, "refused_gap": None},
            {"tier": "default", "p50_gap": 0.02, "p95_gap": -0.03, "sim_refused": 82, "refused_gap": -0.057},
            {"tier": "flex", "p50_gap": 1.65, "p95_gap": 0.21, "sim_refused": 171, "refused_gap": 0.018}]
    verdict = sim_to_real(rows)
    assert verdict["largest_gap"] == {"priority": 0.08, "default": 0.03, "flex": 0.018}
    assert verdict["largest"] == 0.08 and verdict["within_10pct"]
    rows[2]["refused_gap"] = 0.15
    assert not sim_to_real(rows)["within_10pct"]
    rows[2].update(refused_gap=None, sim_refused=3)  # the live run refused no flex request, the simulation some
    assert sim_to_real(rows)["largest_gap"]["flex"] == float("inf")
    rows[2]["sim_refused"] = 0
    assert sim_to_real(rows)["largest_gap"]["flex"] == 0.0


def test_isolation_repeats_below_one_are_refused(capsys):
    from gouache.cli import main

    assert main(["bench", "tiers", "--cost-model", "benchmarks/results/tiers/costmodel_tiny-sdxl_cpu.json",
                 "--isolation-repeats", "0"]) == 2
    assert "--isolation-repeats" in capsys.readouterr().err
