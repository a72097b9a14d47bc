"""`gouache bench tiers`' own arithmetic: its traces draw tiers and tenants in their shares
with each tier's SLO, and its table counts each request's outcome in its tier."""

from gouache.bench.tiers import TENANT_SHARES, TIER_SHARES, Outcome, make_trace, tier_rows


def test_a_trace_draws_tiers_and_tenants_in_their_shares_with_each_tiers_slo():
    slo = {"priority": 1.0, "default": 10.0, "flex": None}
    trace = make_trace(50.0, 100.0, [(256, 256), (384, 384)], 10, TIER_SHARES, TENANT_SHARES, slo, seed=0)
    assert 4500 < len(trace) < 5500 and trace == sorted(trace, key=lambda r: r.arrival)
    for tier, share in TIER_SHARES.items():
        mine = [r for r in trace if r.tier == tier]
        assert abs(len(mine) / len(trace) - share) < 0.03 and {r.slo_s for r in mine} == {slo[tier]}
    assert abs(sum(r.tenant == "alpha" for r in trace) / len(trace) - TENANT_SHARES["alpha"]) < 0.03


def test_the_table_counts_outcomes_and_slo_per_tier():
    trace = make_trace(10.0, 1.0, [(256, 256)], 10, {"priority": 1.0}, {"a": 1.0}, {"priority": 1.0}, seed=1)
    first, second, *rest = trace
    outcomes = {first.request_id: Outcome("finished", 0.5, 0.4), second.request_id: Outcome("finished", 2.0, 1.9)}
    outcomes.update({r.request_id: Outcome("refused") for r in rest})
    [row] = tier_rows("overload", trace, outcomes)
    assert (row["finished"], row["refused"], row["lost"]) == (2, len(rest), 0)
    assert row["slo_attainment"] == 1 / len(trace) and row["p50_s"] == 1.25
