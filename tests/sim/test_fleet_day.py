"""The fleet day: its diurnal trace's shape and mix, its step cost's measured ratios, its
approximations against fuller simulations, the device search, and its place in the CLI."""

import argparse
import json

import numpy as np
import pytest

from gouache.cli import main
from gouache.sched.plan import Batch
from gouache.sched.router import RouteRequest
from gouache.sim import exp_fleet_day, exp_fleet_day_error, reproduce
from gouache.sim.costs import state_of
from gouache.sim.diurnal import DayMix, Diurnal, fleet_day_trace, truncated_pareto
from gouache.sim.exp_fleet_day import FleetDaySetup, fleet_day_experiment, run_cell, search_devices, summarize
from gouache.sim.fleet_cost import CONTROLNET_STEP_RATIO, LORA_STEP_RATIO, FleetStepCost
from gouache.sim.workloads import SimRequest

PLAIN = exp_fleet_day.PLAIN


def trace(mean_rps=2.0, day_s=7200.0, seed=0, **mix):
    return fleet_day_trace(Diurnal(mean_rps, day_s=day_s), DayMix(**mix), PLAIN.standalone, seed=seed)


# -- the trace ----------------------------------------------------------------------------

def test_the_rate_peaks_at_its_hour_and_arrivals_follow_it():
    day = Diurnal(mean_rps=3.0, amplitude=0.6, peak_hour=20.0, day_s=8640.0)  # an hour is 360 s
    assert day.rate(20 * 360.0) == pytest.approx(4.8) and day.rate(8 * 360.0) == pytest.approx(1.2)
    assert day.cumulative(np.array([8640.0]))[0] == pytest.approx(3.0 * 8640)
    arrivals = day.arrivals(np.random.default_rng(0))
    hourly = np.histogram(arrivals, bins=24, range=(0, 8640))[0]
    expected = np.diff(day.cumulative(np.linspace(0, 8640, 25)))
    assert len(arrivals) == pytest.approx(3.0 * 8640, rel=0.03)
    assert np.argmax(hourly) in (19, 20) and np.argmin(hourly) in (7, 8)
    assert np.abs(hourly / expected - 1).max() < 0.12  # ~1,000 an hour: Poisson noise ~3 %, shape kept


def test_the_mix_has_its_shares_and_a_heavy_tailed_mask():
    t = trace(mean_rps=4.0)  # ~28,800 requests
    n = len(t.requests)
    sizes = np.array([r.width for r in t.requests])
    assert [np.mean(sizes == s) for s in (512, 768, 1024)] == pytest.approx([0.3, 0.3, 0.4], abs=0.015)
    edits = [r for r in t.requests if r.mask_ratio is not None]
    assert len(edits) / n == pytest.approx(0.3, abs=0.015)
    assert len(t.lora) / n == pytest.approx(0.3, abs=0.015)
    assert not t.controlnet & {r.request_id for r in edits}  # an edit is conditioned by its image
    assert len(t.controlnet) / (n - len(edits)) == pytest.approx(0.15, abs=0.015)
    tiers = [r.tier for r in t.requests]
    assert [tiers.count(k) / n for k in ("priority", "default", "flex")] == pytest.approx([0.2, 0.6, 0.2], abs=0.015)
    masks = np.array([r.mask_ratio for r in edits])
    assert masks.min() >= 0.03 and masks.max() <= 1.0
    assert np.median(masks) < 0.08 < masks.mean() < 0.18  # most small, the mean pulled up by the tail
    assert np.percentile(masks, 99) > 0.6
    by_tier = {r.tier: r for r in t.requests if r.width == 1024}
    assert by_tier["priority"].slo_s == pytest.approx(2 * PLAIN.standalone(1024, 1024, 28))
    assert by_tier["default"].slo_s == pytest.approx(5 * PLAIN.standalone(1024, 1024, 28))
    assert by_tier["flex"].slo_s is None


def test_the_truncated_pareto_matches_its_cdf():
    x = truncated_pareto(np.random.default_rng(1), 200_000, 0.03, 0.8)
    for q in (0.1, 0.5):
        tail = (0.03**0.8 * q**-0.8 - 0.03**0.8) / (1 - 0.03**0.8)  # P(X > q)
        assert np.mean(x > q) == pytest.approx(tail, rel=0.03)


def test_a_trace_is_seeded_and_its_mix_does_not_move_with_the_rate():
    a, b = trace(seed=3), trace(seed=3)
    assert a.requests == b.requests and a.lora == b.lora
    slower = trace(mean_rps=1.0, seed=3)
    assert [r.width for r in slower.requests] == [r.width for r in a.requests[:len(slower.requests)]]


# -- the cost -----------------------------------------------------------------------------

def test_the_cost_gives_a_lone_request_the_measured_ratios():
    t = trace(mean_rps=0.2, day_s=3600.0)
    cost = FleetStepCost.for_trace(t)
    res = (1024, 1024)
    plain = cost.alone_s("nobody", res)
    assert plain == pytest.approx(0.243, abs=1e-3)  # InstGenIE's anchor: a FLUX step on an H100
    large = {r.request_id for r in t.requests if r.width == 1024}
    generations = {r.request_id for r in t.requests if r.mask_ratio is None} & large
    lora = next(iter(t.lora & generations - t.controlnet))
    cn = next(iter(t.controlnet & large - t.lora))
    assert cost.alone_s(lora, res) / plain == pytest.approx(LORA_STEP_RATIO)
    assert cost.alone_s(cn, res) / plain == pytest.approx(CONTROLNET_STEP_RATIO)
    both = next(iter(t.lora & t.controlnet & large))
    assert cost.alone_s(both, res) > cost.alone_s(cn, res)
    edit = next(r for r in t.requests if r.mask_ratio is not None and r.request_id not in t.lora and r.width == 1024)
    assert cost.alone_s(edit.request_id, res) < plain
    # the router prices what the simulator charges; the predictor sees plain generations
    ids = [lora, cn, edit.request_id]
    route = [RouteRequest(rid, 1024 * 1024, 28, cost.base.mask_ratio.get(rid, 1.0)) for rid in ids]
    states = {rid: state_of(SimRequest(rid, 0.0, 1024, 1024, 28)) for rid in [*ids, "x", "y", "z"]}
    assert cost.batch_step_time(route) == pytest.approx(cost(Batch(tuple(ids)), states))
    assert cost.step_time([res] * 3, patched=True) == pytest.approx(cost(Batch(("x", "y", "z")), states))
    mixed = {"x": states["x"], "s": state_of(SimRequest("s", 0.0, 512, 512, 28))}
    assert cost(Batch(("x", "s"), patched=True), mixed) == pytest.approx(1.05 * cost(Batch(("x", "s")), mixed))


# -- the simulation and its approximations ------------------------------------------------

def small(**kw) -> FleetDaySetup:
    base = dict(devices=4, cells=2, mean_rps_per_device=0.1, compress=96.0, workers=1,
                search=(("least-requests", "orca"),))
    return FleetDaySetup(**{**base, **kw})


def test_an_idle_fleet_gives_each_request_its_unloaded_latency():
    setup = small(mean_rps_per_device=0.002, compress=24.0)  # a request every few minutes a cell
    run = run_cell(setup, "least-requests", "orca", replicas=2)
    assert run.latency.size >= 5 and run.latency == pytest.approx(run.alone)
    assert summarize(run, setup, 4)["p95_over_unloaded"] == pytest.approx(1.0)


@pytest.mark.slow
def test_compressed_hours_and_a_sampled_cell_agree_with_a_fuller_simulation():
    """A small fleet simulated whole (every cell, hours 8x shorter), four times over, against
    the approximation (one cell, hours 96x shorter), 48 times over so both samples are as large:
    counts scaled alike, the mean slowdown within 6 %, the p95 within 12 % (a two-replica cell's
    p95 moves by ~10 % from one draw to the next)."""
    full = small(compress=8.0, cells_simulated=2)
    approx = small(compress=96.0, cells_simulated=1)
    full_run = exp_fleet_day.merge([run_cell(full, "least-requests", "orca", 2, cell=c) for c in range(8)])
    approx_run = exp_fleet_day.merge([run_cell(approx, "least-requests", "orca", 2, cell=c) for c in range(48)])
    exact, pooled = summarize(full_run, full, 4), summarize(approx_run, approx, 4)
    assert pooled["requests_per_day"] / 48 == pytest.approx(exact["requests_per_day"] / 4, rel=0.05)
    assert exact["images_per_device_hour"] / 4 == pytest.approx(0.1 * 3600, rel=0.05)  # everything served
    slowdown = [np.mean(run.latency / run.alone) for run in (full_run, approx_run)]
    assert slowdown[0] > 1.2 and slowdown[1] == pytest.approx(slowdown[0], rel=0.06)  # loaded, and alike
    assert pooled["latency_p95_s"] == pytest.approx(exact["latency_p95_s"], rel=0.12)


def test_the_search_finds_the_threshold_of_a_monotone_ratio():
    calls = []

    def evaluate(sizes):
        calls.append(sizes)
        return {n: 100 / n for n in sizes}  # passes 2.0 from n = 50

    assert search_devices(evaluate, {80: 100 / 80}, 2.0, resolution=1) == 50
    assert all(len(c) <= 2 for c in calls)
    assert search_devices(lambda s: {n: 100 / n for n in s}, {20: 5.0}, 2.0, resolution=1) == 50  # bracketed upwards


@pytest.mark.slow
def test_the_experiment_writes_its_table_plot_and_device_count(tmp_path):
    data = fleet_day_experiment(tmp_path, small(workers=2, routers=("least-requests", "mask-aware"),
                                                policies=("orca", "patched-slo")))
    assert {(r["router"], r["policy"]) for r in data["rows"]} == {
        (r, p) for r in ("least-requests", "mask-aware") for p in ("orca", "patched-slo")}
    row = data["rows"][0]
    assert row["device_hours"] == 4 * 24 and len(row["hourly_p95_over_unloaded"]) == 24
    search = data["searches"][0]
    passing = [t["devices"] for t in search["tried"] if t["p95_over_unloaded"] <= 2.0]
    assert search["devices"] == min(passing)
    assert json.loads((tmp_path / "fleet_day.json").read_text())["searches"][0]["devices"] == search["devices"]
    assert "devices" in (tmp_path / "fleet_day.md").read_text()
    assert (tmp_path / "fleet_day.png").stat().st_size > 0


def test_setup_refuses_what_it_cannot_simulate():
    with pytest.raises(ValueError, match="split evenly"):
        FleetDaySetup(devices=1000, cells=3)
    with pytest.raises(ValueError, match="search names"):
        FleetDaySetup(search=(("round-robin", "orca"),))


# -- the CLI ------------------------------------------------------------------------------

@pytest.mark.parametrize("name, module, function", [
    ("fleet-day", exp_fleet_day, "fleet_day_experiment"),
    ("fleet-day-error", exp_fleet_day_error, "fleet_day_error_experiment")])
def test_reproduce_runs_the_fleet_day_only_when_asked(name, module, function, monkeypatch, tmp_path, capsys):
    ran = []

    def fake(out):
        ran.append(out)
        (out / "table.md").write_text("| table |\n")
        return {}

    monkeypatch.setattr(module, function, fake)
    assert name in reproduce.EXPERIMENTS and name in reproduce.LONG
    assert main(["reproduce", "--only", name, "--out", str(tmp_path)]) == 0
    assert ran == [tmp_path / name] and "| table |" in capsys.readouterr().out
    parser = argparse.ArgumentParser()
    reproduce.add_arguments(parser)
    assert name not in parser.parse_args([]).only.split(",")  # minutes: not in the default run


# -- coarse steps -------------------------------------------------------------------------

def test_coarse_steps_run_a_plan_up_to_k_steps_and_never_past_a_members_last():
    from gouache.config import SchedulerConfig
    from gouache.sched.policies import make_policy
    from gouache.sim.coarse import CoarseSteps
    from gouache.sim.costs import LinearStepCost
    from gouache.sim.simulator import simulate

    cost = LinearStepCost(per_megapixel_s=1.0)  # 1 s a step of a 1 MP image, alone or batched
    trace = [SimRequest("a", 0.0, 1000, 1000, 6), SimRequest("b", 0.0, 1000, 1000, 3),
             SimRequest("late", 0.5, 1000, 1000, 2)]
    plans = {}
    for k in (1, 4):
        policy = CoarseSteps(make_policy(SchedulerConfig(policy="orca", max_batch_size=8)), k)
        result = simulate(trace, policy, cost, record_plans=True)
        plans[k] = [(t, [b.steps for b in p.batches]) for t, p in result.plans]
        finish = {r.request.request_id: r.finish for r in result.records}
        # k = 1: a and b step 0-2 (2 s a step); late joins at 2, three step 2-5 and 5-8; a goes on alone.
        # k = 4: a and b run 3 steps, 0-6 (b's last, not 4); late joins at 6, with a 6-10; a alone 10-11.
        assert (finish["a"], finish["b"], finish["late"]) == {1: (11.0, 8.0, 8.0), 4: (11.0, 6.0, 10.0)}[k]
    assert plans[4][:2] == [(0.0, [3]), (6.0, [2])]
    assert all(steps == [1] for _, steps in plans[1])
    with pytest.raises(ValueError, match="not a step policy"):
        CoarseSteps(make_policy(SchedulerConfig(policy="round-knapsack"), cost), 4)
