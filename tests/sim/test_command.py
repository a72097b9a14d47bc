"""`gouache simulate` over every kind of policy, router and cost it offers."""

import json

import pytest

from gouache.cli import main
from gouache.sched.router import ROUTERS, RouteRequest
from gouache.sim.costs import linear_step_cost


def simulate(tmp_path, *args: str) -> list[dict]:
    out = tmp_path / "sim.json"
    assert main(["simulate", *args, "--out", str(out)]) == 0
    return json.loads(out.read_text())["results"]


def test_round_policies_run_over_a_device_pool(tmp_path):
    results = simulate(tmp_path, "--policies", "round-knapsack,fixed-sp-8", "--devices", "8", "--sizes", "256,1024",
                       "--requests", "40", "--rate", "0.2", "--slo-scale", "1.5")
    assert [r["policy"] for r in results] == ["round-knapsack", "fixed-sp-8"]
    for result in results:
        assert result["metrics"]["finished"] + result["metrics"]["unfinished"] == 40
        assert all(r["finish"] is None or r["finish"] > r["arrival"] for r in result["requests"])


def test_any_policy_runs_on_replicas_of_device_pools(tmp_path):
    (knapsack, fixed_one) = simulate(tmp_path, "--policies", "round-knapsack,fixed-sp-1", "--devices", "2",
                                     "--replicas", "2", "--sizes", "256,1024", "--requests", "30", "--rate", "0.5")
    for result in (knapsack, fixed_one):
        assert result["metrics"]["finished"] == 30 and {r["replica"] for r in result["requests"]} == {0, 1}


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_step_policies_run_on_replicas_behind_every_router(tmp_path, router):
    (result,) = simulate(tmp_path, "--policies", "orca", "--replicas", "3", "--router", router,
                         "--requests", "60", "--rate", "1.0", "--sizes", "512,1024")
    assert result["metrics"]["finished"] == 60
    assert {r["replica"] for r in result["requests"]} == {0, 1, 2}


def test_edits_are_priced_by_their_masks(tmp_path):
    small, large = (simulate(tmp_path, "--policies", "orca", "--mask-mean", str(m), "--replicas", "2", "--router",
                             "mask-aware", "--requests", "40", "--rate", "0.3", "--sizes", "1024", "--steps", "28")[0]
                    for m in (0.11, 0.5))
    assert small["metrics"]["latency_p50_s"] < large["metrics"]["latency_p50_s"]
    assert all(0 < r["mask_ratio"] < 1 for r in small["requests"])


@pytest.mark.parametrize("args, message", [
    (["--policies", "orca,fixed-sp-2", "--devices", "2"], "policy 'orca' plans exactly 1 device, not 2"),
    (["--policies", "fixed-sp-4", "--devices", "2"], "policy 'fixed-sp-4' plans 4 or more devices, not 2"),
    (["--policies", "fixed-sp-2", "--devices", "2", "--sizes", "300"], "no step times of 300x300"),
    (["--policies", "patched-slo", "--mask-mean", "0.2"], "without --mask-mean"),
    (["--policies", "fixed-sp-2", "--devices", "2", "--mask-mean", "0.2"], "drop --devices"),
    (["--policies", "no-such-policy"], "unknown policies no-such-policy"),
])
def test_what_cannot_run_is_refused_with_a_reason(capsys, args, message):
    assert main(["simulate", *args]) == 2
    assert message in capsys.readouterr().err


def test_the_stand_in_prices_routed_requests_as_it_prices_steps():
    cost = linear_step_cost(per_megapixel_s=0.08, per_forward_s=0.03)
    full = [RouteRequest("a", 512 * 512, 10), RouteRequest("b", 1024 * 1024, 10)]
    assert cost.batch_step_time(full) == pytest.approx(cost.step_time([(512, 512), (1024, 1024)], patched=True))
    half = [RouteRequest("a", 512 * 512, 10, mask_ratio=0.5)]
    assert cost.batch_step_time(half) == pytest.approx(0.03 + 0.5 * 512 * 512 / 1e6 * 0.08)


@pytest.mark.parametrize("args, flag", [
    (["--policies", "round-knapsack", "--devices", "8", "--max-batch-size", "1"], "--max-batch-size"),
    (["--policies", "fixed-sp-1", "--router", "least-requests"], "--router"),
    (["--policies", "fixed-sp-2", "--devices", "2", "--per-forward-ms", "5"], "--per-forward-ms"),
    (["--policies", "fixed-sp-2", "--devices", "2", "--round-s", "1"], "--round-s"),
    (["--policies", "orca", "--round-s", "1"], "--round-s"),
    (["--policies", "orca", "--router", "mask-aware"], "--router"),
    (["--policies", "orca", "--mask-mean", "0.2", "--per-megapixel-ms", "50"], "--per-megapixel-ms"),
])
def test_flags_the_run_would_ignore_are_refused(capsys, args, flag):
    assert main(["simulate", "--requests", "20", "--sizes", "512,1024", *args]) == 2
    err = capsys.readouterr().err
    assert flag in err and "ignore" in err


def test_a_trace_refuses_the_flags_that_generate_requests(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival,width,height,steps,slo_s\n0.0,512,512,10,20\n1.0,512,512,10,20\n")
    assert len(simulate(tmp_path, "--policies", "orca", "--trace", str(trace))[0]["requests"]) == 2
    for flag, value in (("--rate", "2"), ("--slo-scale", "3"), ("--seed", "0"), ("--sizes", "512")):
        assert main(["simulate", "--policies", "orca", "--trace", str(trace), flag, value]) == 2
        assert flag in capsys.readouterr().err


def test_round_knapsack_on_one_device_takes_the_round_length(tmp_path):
    args = ["--policies", "round-knapsack", "--requests", "30", "--rate", "0.5", "--sizes", "512,1024"]
    finishes = [[r["finish"] for r in simulate(tmp_path, *args, "--round-s", round_s)[0]["requests"]]
                for round_s in ("0.01", "30")]
    assert finishes[0] != finishes[1]
