import json
from collections import Counter
from dataclasses import replace

import pytest

from gouache.config import SchedulerConfig
from gouache.request import RequestState
from gouache.sched.costmodel import MaskCostModel
from gouache.sched.plan import Batch
from gouache.sched.policies import make_policy
from gouache.sched.router import LeastRequestsRouter, LeastTokensRouter, MaskAwareRouter, RoundRobinRouter, RouteRequest
from gouache.sched.scheduler import Scheduler
from gouache.sim.costs import linear_step_cost, standalone_latency
from gouache.sim.exp_instgenie import FluxEditAssumptions, MaskStepCost, instgenie_experiment
from gouache.sim.exp_patchedserve import SdxlH100Assumptions, patchedserve_experiment
from gouache.sim.simulator import Simulator, simulate
from gouache.sim.workloads import PATCHEDSERVE_SIZES, SimRequest, WorkloadSpec, make_workload

ONE_SECOND_STEPS = linear_step_cost(per_forward_s=1.0)  # every step takes 1 s, whatever it holds
TOKENS_512 = 1024  # latent tokens of a 512 px image: (512 / 16)²


def policies(name: str, replicas: int, max_batch: int = 8, predictor=None):
    return [make_policy(SchedulerConfig(policy=name, max_batch_size=max_batch), predictor) for _ in range(replicas)]


def unit_mask_cost(per_forward_s: float = 0.01, per_request_s: float = 0.0) -> MaskStepCost:
    """An unmasked 512 px request costs 1 s of compute per step, so m x 1 s for a mask ratio m."""
    full_flops = MaskCostModel(3072, 57).flops([(TOKENS_512, 1.0)])
    return MaskStepCost(per_forward_s, per_request_s, flops_per_s=full_flops)


def replica_of(result) -> dict[str, int]:
    return {r.request.request_id: r.replica for r in result.records}


def count_steps(monkeypatch) -> Counter[str]:
    """Count the steps each request is advanced by, as the simulator reports them to the Scheduler."""
    steps: Counter[str] = Counter()
    advance = Scheduler.advance

    def counting(self, run, stepped, now, steps_run=1):
        steps.update({rid: steps_run for rid in stepped if rid in self.running})
        return advance(self, run, stepped, now, steps_run)

    monkeypatch.setattr(Scheduler, "advance", counting)
    return steps


# -- routing on hand-made traces -----------------------------------------------------------

def test_least_requests_sends_each_arrival_to_the_emptier_replica():
    # a -> 0 (tie, lowest index); b -> 1 (0 holds a); c -> 0 (1 each); d -> 1 (0 holds a and c)
    trace = [SimRequest(rid, arrival=t, width=512, height=512, steps=4)
             for rid, t in (("a", 0.0), ("b", 0.1), ("c", 0.2), ("d", 0.3))]
    result = simulate(trace, policies("orca", 2), ONE_SECOND_STEPS, router=LeastRequestsRouter())
    assert replica_of(result) == {"a": 0, "b": 1, "c": 0, "d": 1}
    # replica 0: a steps at 0, 1, 2, 3; c joins at 1 and ends at 5. Replica 1 likewise from 0.1.
    assert {r.request.request_id: r.finish for r in result.records} == pytest.approx(
        {"a": 4.0, "b": 4.1, "c": 5.0, "d": 5.1})


def test_mask_aware_prefers_the_replica_whose_batch_has_small_masks():
    # a (mask 0.9) -> 0; b (0.1) -> 1, the empty one. c (0.1) then has one request on each
    # replica: least-requests breaks the tie to 0, mask-aware sees 0.9 s vs 0.1 s a step and takes 1.
    trace = [SimRequest("a", 0.0, 512, 512, 10, mask_ratio=0.9), SimRequest("b", 0.1, 512, 512, 10, mask_ratio=0.1),
             SimRequest("c", 0.2, 512, 512, 10, mask_ratio=0.1)]
    cost = unit_mask_cost()
    charged = cost.for_trace(trace)
    aware = simulate(trace, policies("orca", 2), charged, router=MaskAwareRouter(cost.batch_step_time))
    counted = simulate(trace, policies("orca", 2), charged, router=LeastRequestsRouter())
    assert replica_of(aware) == {"a": 0, "b": 1, "c": 1}
    assert replica_of(counted) == {"a": 0, "b": 1, "c": 0}
    # the masks reach the step cost: b alone steps at 0.01 + 0.1 s, then b and c at 0.01 + 0.2 s
    b, c = aware.records[1], aware.records[2]
    assert c.first_step == pytest.approx(0.1 + 0.11)  # c waits for b's first step to end
    assert b.finish == pytest.approx(0.1 + 0.11 + 9 * 0.21)


def test_simultaneous_arrivals_spread_under_mask_aware():
    # Both arrive at t = 0: replica 0 is idle with a queued, so its load reports a as running
    # (it is about to be), and b goes to the empty replica 1.
    trace = [SimRequest("a", 0.0, 512, 512, 3, mask_ratio=0.2), SimRequest("b", 0.0, 512, 512, 3, mask_ratio=0.2)]
    cost = unit_mask_cost()
    result = simulate(trace, policies("orca", 2), cost.for_trace(trace), router=MaskAwareRouter(cost.batch_step_time))
    assert replica_of(result) == {"a": 0, "b": 1}
    assert [r.finish for r in result.records] == pytest.approx([3 * 0.21, 3 * 0.21])


def test_mask_step_cost_charges_masked_compute_per_request_and_fixed_costs():
    cost = unit_mask_cost(per_forward_s=0.05, per_request_s=0.02)
    trace = [SimRequest("e", 0.0, 512, 512, 1, mask_ratio=0.25), SimRequest("g", 0.0, 512, 512, 1)]
    charged = cost.for_trace(trace)
    assert charged.mask_ratio == {"e": 0.25}  # g is a generation: m = 1
    states = {rid: RequestState(rid, (512, 512), 1, 0.0) for rid in ("e", "g")}
    one_forward = Batch(("e", "g"))
    assert charged(one_forward, states) == pytest.approx(0.05 + (0.02 + 0.25) + (0.02 + 1.0))
    assert charged(Batch(("e",)), states) + charged(Batch(("g",)), states) == pytest.approx(0.05 + 0.27 + 0.05 + 1.02)
    view = [RouteRequest("e", 512 * 512, 1, 0.25), RouteRequest("g", 512 * 512, 1, 1.0)]
    assert cost.batch_step_time(view) == pytest.approx(charged(one_forward, states))


# -- accounting across replicas ------------------------------------------------------------

@pytest.mark.parametrize("router_name", ["round-robin", "least-requests", "least-tokens", "mask-aware"])
@pytest.mark.parametrize("policy_name", ["orca", "patched"])
def test_every_request_runs_all_its_steps_and_finishes_exactly_once(policy_name, router_name, monkeypatch):
    trace = make_workload(WorkloadSpec(num_requests=150, rate=3.0, sizes=PATCHEDSERVE_SIZES, steps=8,
                                       mask_mean=0.19, seed=4))
    cost = FluxEditAssumptions().cost()
    router = {"round-robin": RoundRobinRouter(), "least-requests": LeastRequestsRouter(),
              "least-tokens": LeastTokensRouter(), "mask-aware": MaskAwareRouter(cost.batch_step_time)}[router_name]
    steps = count_steps(monkeypatch)
    result = simulate(trace, policies(policy_name, 3), cost.for_trace(trace), router=router)
    assert steps == {r.request_id: r.steps for r in trace}  # no request ran twice or partly
    assert all(r.finish is not None and r.replica in (0, 1, 2) for r in result.records)
    assert result.metrics().finished == len(trace) == len(result.records)
    assert len({r.replica for r in result.records}) == 3  # the load was spread
    assert 0 < result.metrics().utilization <= 1  # busy time is the mean over replicas


@pytest.mark.parametrize("name", ["fcfs-static", "orca", "patched", "patched-slo"])
def test_one_replica_behind_a_router_is_the_single_replica_simulator(name):
    cost = SdxlH100Assumptions().cost()
    trace = make_workload(WorkloadSpec(num_requests=80, rate=0.8, sizes=PATCHEDSERVE_SIZES, steps=20,
                                       slo_scale=2.0, seed=2), standalone_latency(cost))  # overloaded: drops

    def run(**router):
        policy = make_policy(SchedulerConfig(policy=name, max_batch_size=8), cost)
        return simulate(trace, policy if not router else [policy], cost, **router)

    alone = run()
    for router in (LeastRequestsRouter(), MaskAwareRouter(lambda batch: 0.1 * len(batch))):
        routed = run(router=router)
        assert [(r.first_step, r.finish, r.dropped_at) for r in routed.records] == \
               [(r.first_step, r.finish, r.dropped_at) for r in alone.records]
        assert routed.metrics() == alone.metrics()
    if name == "patched-slo":
        assert alone.metrics().dropped > 0  # the comparison covered drops too


def test_replicas_need_their_own_policies_and_a_router():
    policy = make_policy(SchedulerConfig(policy="orca"))
    with pytest.raises(ValueError, match="own policy instance"):
        Simulator([policy, policy], ONE_SECOND_STEPS, router=LeastRequestsRouter())
    with pytest.raises(ValueError, match="need a router"):
        Simulator(policies("orca", 2), ONE_SECOND_STEPS)


# -- cost models and experiments -----------------------------------------------------------

def test_sdxl_cost_reproduces_its_anchors_and_batching_pays():
    cost = SdxlH100Assumptions().cost()
    small, medium, large = (512, 512), (768, 768), (1024, 1024)
    assert cost.step_time([large], patched=False) == pytest.approx(0.100)
    assert cost.step_time([large], patched=False) / cost.step_time([small], patched=False) == pytest.approx(1.3)
    mixed = [small, medium, large]
    assert cost.step_time(mixed, patched=True) < 0.7 * cost.step_time(mixed, patched=False)
    assert cost.step_time([small] * 4, patched=False) < 1.5 * cost.step_time([small], patched=False)  # sub-linear


def test_flux_edit_cost_reproduces_instgenies_speedup_and_batching_gain():
    cost = FluxEditAssumptions().cost()

    def step(mask, batch=1):
        return cost.batch_step_time([RouteRequest("r", 1024 * 1024, 1, mask)] * batch)

    assert step(1.0) == pytest.approx(0.243, abs=1e-3)
    assert step(1.0) / step(0.2) == pytest.approx(1.9)
    gain = (4 * step(0.2) / step(0.2, 4)) / (4 * step(1.0) / step(1.0, 4))
    assert gain == pytest.approx(1.29)
    assert FluxEditAssumptions(batching_gain=None).cost().per_request_s == 0.0


def test_experiments_write_tables_plots_and_json(tmp_path):
    ps = patchedserve_experiment(tmp_path / "ps", rates=(0.2, 0.4), num_requests=30, seeds=(0,))
    assert {p["policy"] for p in ps["points"]} == {"fcfs-static", "orca", "patched", "patched-slo"}
    assert len(ps["margins"]["per_rate"]) == 2
    ig = instgenie_experiment(tmp_path / "ig", loads=(0.7,), mask_means=(0.11,), cost_models=("2-term",),
                              num_requests=40, seeds=(0,), workers=1)
    assert {p["router"] for p in ig["points"]} == {"round-robin", "least-requests", "least-tokens", "mask-aware"}
    assert {p["masks"] for p in ig["points"]} == {"beta", "heavy"}
    for path in ("ps/patchedserve.json", "ps/patchedserve.md", "ig/instgenie.json", "ig/instgenie.md"):
        assert (tmp_path / path).stat().st_size > 0
    for png in (tmp_path / "ps/patchedserve.png", tmp_path / "ig/instgenie_2-term_mask0.11_heavy.png"):
        assert png.read_bytes()[:4] == b"\x89PNG"


def test_overhead_benchmark_times_every_policy(tmp_path):
    from gouache.bench.overhead import run_overhead

    data = run_overhead(tmp_path / "overhead.json", waiting=(10,))
    assert {row["policy"] for row in data["rows"]} >= {"fcfs-static", "orca", "patched", "patched-slo"}
    assert all(row["median_ms"] > 0 for row in data["rows"])
    assert (tmp_path / "overhead.md").read_text().startswith("# scheduling decision time")


def test_patchedserve_reruns_with_each_measured_patch_overhead(tmp_path):
    from gouache.sim.exp_patchedserve import measured_overhead

    bench = {"model": "tiny-sdxl", "device": "CPU", "dtype": "float32", "results": [
        # one size runs as a plain batch (1.0); the machinery forced on is what is charged
        {"mix": "SSS", "resolutions": 1, "method": "patched", "patched_vs_grouped": 1.0, "forced_vs_grouped": 1.10},
        {"mix": "4M", "resolutions": 1, "method": "patched", "patched_vs_grouped": 1.0, "forced_vs_grouped": 1.30},
        {"mix": "LLL", "resolutions": 1, "method": "patched", "patched_vs_grouped": 1.0, "forced_vs_grouped": 1.20},
        {"mix": "SML", "resolutions": 3, "method": "patched", "patched_vs_grouped": 0.60}]}  # batching gain: not read
    path = tmp_path / "batching.json"
    path.write_text(json.dumps(bench))
    name, overhead = measured_overhead(path)
    assert overhead == pytest.approx(0.20) and name.startswith("tiny-sdxl patched, CPU")
    ps = patchedserve_experiment(tmp_path / "ps", rates=(0.2, 0.4), num_requests=30, seeds=(0,),
                                 batching_costs=[path])
    assert [s["patch_overhead"] for s in ps["sources"]] == [pytest.approx(0.05), pytest.approx(0.20)]
    assert "by source of the patched overhead" in (tmp_path / "ps/patchedserve.md").read_text()
    path.write_text(json.dumps({**bench, "results": bench["results"][3:]}))
    with pytest.raises(ValueError, match="no one-resolution mix"):
        measured_overhead(path)


def test_patchedserve_reruns_charged_by_a_profiled_cost_model(tmp_path):
    from gouache.sched.costmodel import BatchCostModel, save

    model = BatchCostModel([512, 768, 1024])
    mp = {512: 0.26, 768: 0.59, 1024: 1.05}
    for size, megapixels in mp.items():
        for batch in (1, 2, 3):
            model.record_grouped(size, batch, 0.03 + 0.04 * batch * megapixels)
    samples = [({(a, a): 1, (b, b): n}, 0.035 + 0.04 * (mp[a] + n * mp[b]))
               for a in mp for b in mp if a != b for n in (1, 2)]
    model.fit(samples)
    path = tmp_path / "costmodel.json"
    save(model, path)
    (tmp_path / "costmodel.report.json").write_text(json.dumps({"model": "sdxl-arch", "device": "cuda"}))
    ps = patchedserve_experiment(tmp_path / "ps", rates=(0.2, 0.4), num_requests=30, seeds=(0,), batching_costs=[path])
    row = ps["sources"][1]
    assert row["source"] == "sdxl-arch profiled on cuda, batches of <= 3 (measured)" and row["max_batch"] == 3
    assert row["patch_overhead"] is None and {p["policy"] for p in row["points"]} == {"fcfs-static", "orca", "patched",
                                                                                    "patched-slo"}
    assert row["points"] != ps["points"]  # its own sweep, charged by the profile
    save(BatchCostModel([512, 1024]), path)
    with pytest.raises(ValueError, match="not a batch cost model of 512 px, 768 px, 1024 px"):
        patchedserve_experiment(tmp_path / "ps", rates=(0.2,), num_requests=10, seeds=(0,), batching_costs=[path])


def test_patchedserve_reruns_with_a_measured_block_cache_saving(tmp_path):
    from gouache.sim.exp_patchedserve import measured_cache_saving

    fidelity = {"model": "shapes-unet", "candidate": {"policy": "patched", "block_cache": 0.1}, "denoise_ratio": 0.9,
                "steady_step_ratio": 0.7, "ssim_mean": 0.96, "alignment_drop_points": 1.0}
    path = tmp_path / "fidelity.json"
    path.write_text(json.dumps(fidelity))
    name, saving = measured_cache_saving(path)
    assert saving == pytest.approx(0.3) and "SSIM 0.960" in name
    ps = patchedserve_experiment(tmp_path / "ps", rates=(0.2, 0.4), num_requests=30, seeds=(0,), batching_costs=[path])
    assert [s["cache_saving"] for s in ps["sources"]] == [0.0, pytest.approx(0.3)]
    cost = SdxlH100Assumptions().cost()
    cached = replace(cost, cache_saving=0.3)
    sizes = [(1024, 1024)] * 4
    assert cached.forward(sizes, False) == cost.forward(sizes, False)  # the baselines run without it
    assert cached.forward(sizes, True) < cost.forward(sizes, True)
    path.write_text(json.dumps({**fidelity, "candidate": {"policy": "orca", "block_cache": 0.0}}))
    with pytest.raises(ValueError, match="not a block-cache run"):
        measured_cache_saving(path)


def test_a_one_size_patched_forward_costs_a_plain_batch():
    from gouache.sim.exp_patchedserve import SdxlH100Assumptions

    cost = SdxlH100Assumptions().cost()
    same, mixed = [(512, 512)] * 2, [(512, 512), (1024, 1024)]
    assert cost.forward(same, patched=True) == cost.forward(same, patched=False)  # the engine runs it unpatched
    plain = cost.forward(mixed, patched=False) - cost.per_forward_s
    assert cost.forward(mixed, patched=True) - cost.per_forward_s == pytest.approx(plain * 1.05)
