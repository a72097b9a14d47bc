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
