import json
import math

import numpy as np
import pytest

from gouache.config import SchedulerConfig
from gouache.request import RequestState
from gouache.sched.interface import Policy
from gouache.sched.plan import Batch, Plan
from gouache.sched.policies import make_policy
from gouache.sim.costs import linear_step_cost, standalone_latency
from gouache.sim.report import markdown_table, plot_sweep, result_to_dict, summary_row
from gouache.sim.simulator import simulate
from gouache.sim.workloads import (
    PATCHEDSERVE_SIZES,
    TETRISERVE_SIZES,
    SimRequest,
    WorkloadSpec,
    inter_arrival_cv,
    make_workload,
    read_trace,
    size_probabilities,
    write_trace,
)

# 512² costs 1 s of pixels and 1024² costs 4 s: 0.262144 MP × 15625/4096 s/MP = 1.0
HAND_COST = linear_step_cost(per_forward_s=1.5, per_megapixel_s=15625 / 4096)
HAND_TRACE = [
    SimRequest("a", arrival=0.0, width=512, height=512, steps=2),
    SimRequest("b", arrival=1.0, width=512, height=512, steps=2),
    SimRequest("c", arrival=2.0, width=1024, height=1024, steps=1),
]


def policy(name: str, max_batch: int = 8) -> Policy:
    return make_policy(SchedulerConfig(policy=name, max_batch_size=max_batch))


def times(result) -> dict[str, tuple[float | None, float | None]]:
    return {r.request.request_id: (r.first_step, r.finish) for r in result.records}


# -- workloads -----------------------------------------------------------------------------

def test_workloads_are_deterministic_per_seed():
    spec = dict(num_requests=200, rate=2.0, cv=2.0, mix="skewed", mask_mean=0.11)
    assert make_workload(WorkloadSpec(**spec, seed=3)) == make_workload(WorkloadSpec(**spec, seed=3))
    assert make_workload(WorkloadSpec(**spec, seed=3)) != make_workload(WorkloadSpec(**spec, seed=4))


def test_changing_the_rate_keeps_sizes_and_masks():
    slow, fast = (make_workload(WorkloadSpec(num_requests=50, rate=r, mask_mean=0.19)) for r in (0.5, 5.0))
    assert [(r.width, r.mask_ratio) for r in slow] == [(r.width, r.mask_ratio) for r in fast]


def test_poisson_mean_gap_is_one_over_rate():
    requests = make_workload(WorkloadSpec(num_requests=20_000, rate=4.0, seed=1))
    gaps = np.diff([0.0, *(r.arrival for r in requests)])
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert inter_arrival_cv(requests) == pytest.approx(1.0, abs=0.05)


def test_bursty_arrivals_have_the_asked_cv_and_the_same_mean_rate():
    bursty = make_workload(WorkloadSpec(num_requests=20_000, rate=4.0, cv=3.0, seed=1))
    poisson = make_workload(WorkloadSpec(num_requests=20_000, rate=4.0, seed=1))
    assert inter_arrival_cv(bursty) == pytest.approx(3.0, rel=0.1)
    assert inter_arrival_cv(bursty) > 2 * inter_arrival_cv(poisson)
    assert bursty[-1].arrival / len(bursty) == pytest.approx(0.25, rel=0.1)


def test_skewed_mix_follows_tetriserve_formula():
    # L_i / L_max = 1/64, 4/64, 16/64, 1 for 256..2048 squares
    weights = np.exp([1 / 64, 4 / 64, 16 / 64, 1.0])
    expected = weights / weights.sum()
    assert size_probabilities(TETRISERVE_SIZES, "skewed", alpha=1.0) == pytest.approx(expected)
    assert size_probabilities(TETRISERVE_SIZES, "uniform") == pytest.approx([0.25] * 4)
    requests = make_workload(WorkloadSpec(num_requests=40_000, rate=1.0, mix="skewed", seed=2))
    counts = np.array([sum(r.width == w for r in requests) for w, _ in TETRISERVE_SIZES]) / len(requests)
    assert counts == pytest.approx(expected, abs=0.01)
    assert list(counts) == sorted(counts)  # larger sizes are more likely


@pytest.mark.parametrize("mean", [0.11, 0.19])
def test_mask_ratios_have_instgenies_mean(mean):
    masks = np.array([r.mask_ratio for r in make_workload(WorkloadSpec(num_requests=20_000, rate=1.0, mask_mean=mean))])
    assert masks.mean() == pytest.approx(mean, rel=0.03)
    assert masks.min() > 0 and masks.max() < 1
    assert masks.std() / masks.mean() > 0.5  # "significant variation"


def test_slo_is_scale_times_standalone_latency():
    solo = standalone_latency(HAND_COST)
    assert solo(512, 512, 10) == pytest.approx(10 * 2.5)
    requests = make_workload(WorkloadSpec(num_requests=20, rate=1.0, sizes=PATCHEDSERVE_SIZES, steps=10,
                                          slo_scale=5.0), solo)
    for r in requests:
        assert r.slo_s == pytest.approx(5.0 * solo(r.width, r.height, 10))
    with pytest.raises(ValueError, match="standalone_latency"):
        make_workload(WorkloadSpec(num_requests=1, rate=1.0, slo_scale=2.0))


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_trace_files_round_trip(tmp_path, suffix):
    requests = make_workload(WorkloadSpec(num_requests=30, rate=1.5, mask_mean=0.19, slo_scale=3.0,
                                          cv=2.0, mix="skewed"), lambda w, h, s: w * h * s / 1e7)
    requests.append(SimRequest("plain", arrival=99.0, width=640, height=384, steps=7))  # no SLO, no mask
    path = tmp_path / f"trace{suffix}"
    write_trace(path, requests)
    assert read_trace(path) == requests


def test_recorded_arrivals_replay_without_ids_or_optional_columns(tmp_path):
    path = tmp_path / "recorded.csv"
    path.write_text("arrival,width,height,steps\n0.5,512,512,30\n1.25,1024,768,30\n")
    assert read_trace(path) == [SimRequest("r0", 0.5, 512, 512, 30), SimRequest("r1", 1.25, 1024, 768, 30)]
    path = tmp_path / "recorded.jsonl"
    path.write_text('{"arrival": 2, "width": 256, "height": 256, "steps": 4, "slo_s": null}\n')
    assert read_trace(path) == [SimRequest("r0", 2.0, 256, 256, 4)]


# -- simulator -----------------------------------------------------------------------------

def test_orca_matches_hand_computed_times():
    # a forward costs 1.5 + pixel cost; a 512² costs 1, a 1024² costs 4. A step's forwards run in turn.
    # t=0    a alone: [a] = 2.5                          -> 2.5
    # t=2.5  b, c join: [a, b] = 3.5, then [c] = 5.5     -> 6.0 a (2 steps) done, 11.5 c (1 step) done
    # t=11.5 [b] = 2.5                                   -> 14.0; b done
    result = simulate(HAND_TRACE, policy("orca"), HAND_COST)
    assert times(result) == {"a": (0.0, pytest.approx(6.0)), "b": (2.5, pytest.approx(14.0)),
                             "c": (6.0, pytest.approx(11.5))}
    m = result.metrics()
    assert m.num_steps == 4 and m.utilization == pytest.approx(1.0) and m.makespan_s == pytest.approx(14.0)
    assert m.queueing_mean_s == pytest.approx((0 + 1.5 + 4.0) / 3)


def test_fcfs_static_matches_hand_computed_times():
    # a alone for 2 steps (0 -> 5), then b alone (5 -> 10), then c: 0.5 + 1 + 4 = 5.5 (10 -> 15.5)
    result = simulate(HAND_TRACE, policy("fcfs-static"), HAND_COST)
    assert times(result) == {"a": (0.0, pytest.approx(5.0)), "b": (pytest.approx(5.0), pytest.approx(10.0)),
                             "c": (pytest.approx(10.0), pytest.approx(15.5))}
    assert result.metrics().queueing_mean_s == pytest.approx((0 + 4 + 8) / 3)


def test_stage_work_is_charged_to_the_next_step():
    # each request: 0.25 s of preparation on arrival, 1 s of post-processing when done (orca, as above)
    # t=0     a's prep is backlog: [a] = 0.25 + 2.5                        -> 2.75
    # t=2.75  b's and c's preps: [a, b] = 0.5 + 3.5                        -> 6.75; a done
    # t=6.75  a's post-processing: [c] = 1 + 5.5                           -> 13.25; c done
    # t=13.25 c's post-processing: [b] = 1 + 2.5                           -> 16.75
    result = simulate(HAND_TRACE, policy("orca"), HAND_COST, stage_cost=lambda state: (0.25, 1.0))
    assert times(result) == {"a": (0.0, pytest.approx(6.75)), "b": (2.75, pytest.approx(16.75)),
                             "c": (6.75, pytest.approx(13.25))}


@pytest.mark.parametrize("arrival, finish", [(3.0, 6.0), (10.0, 12.5)])
def test_an_idle_device_works_off_the_stage_backlog(arrival, finish):
    # a's 1 s of post-processing starts at 2.5: half is left at 3.0, none at 10.0
    trace = [SimRequest("a", 0.0, 512, 512, 1), SimRequest("b", arrival, 512, 512, 1)]
    result = simulate(trace, policy("orca"), HAND_COST, stage_cost=lambda state: (0.0, 1.0))
    assert times(result)["b"] == (arrival, pytest.approx(finish))


def test_arrival_at_a_step_end_joins_the_next_step():
    trace = [SimRequest("a", 0.0, 512, 512, 2), SimRequest("b", 2.5, 512, 512, 1)]
    result = simulate(trace, policy("orca"), HAND_COST)
    assert times(result) == {"a": (0.0, pytest.approx(6.0)), "b": (2.5, pytest.approx(6.0))}


@pytest.mark.parametrize("name", ["orca", "fcfs-static", "patched"])
def test_single_request_latency_is_steps_times_step_cost(name):
    cost = linear_step_cost(per_forward_s=0.023, per_megapixel_s=0.07)
    request = SimRequest("only", arrival=3.0, width=768, height=1024, steps=25)
    result = simulate([request], policy(name), cost)
    one_step = 0.023 + 768 * 1024 / 1e6 * 0.07
    assert result.records[0].latency == pytest.approx(25 * one_step)
    assert result.records[0].queueing == 0.0


def test_linear_cost_predicts_what_it_charges():
    states = {"a": RequestState("a", (512, 512), 2, 0.0), "b": RequestState("b", (512, 512), 2, 0.0),
              "c": RequestState("c", (1024, 1024), 1, 0.0)}
    resolutions = [s.resolution for s in states.values()]
    grouped = HAND_COST(Batch(("a", "b")), states) + HAND_COST(Batch(("c",)), states)
    patched = HAND_COST(Batch(("a", "b", "c"), patched=True), states)
    assert grouped == pytest.approx(HAND_COST.step_time(resolutions, patched=False)) == pytest.approx(9.0)
    assert patched == pytest.approx(HAND_COST.step_time(resolutions, patched=True)) == pytest.approx(7.5)


def test_slo_misses_are_recorded_not_dropped():
    trace = [SimRequest("a", 0.0, 512, 512, 2, slo_s=100.0), SimRequest("b", 0.0, 512, 512, 2, slo_s=5.5)]
    result = simulate(trace, policy("fcfs-static", max_batch=1), HAND_COST)
    assert [r.met_slo for r in result.records] == [True, False]  # b finishes at 10 > 5.5, still finishes
    m = result.metrics()
    assert m.slo_attainment == 0.5 and m.finished == 2 and m.dropped == 0


class _DropSmallOneAtATime(Policy):
    """Drops one 512-wide request per plan and runs nothing while any is left."""

    name = "drop-small"

    def plan(self, waiting, running, now, devices):
        small = [s.request_id for s in waiting if s.resolution[1] == 512]
        return Plan(drop=small[:1]) if small else make_policy(self.config).plan(waiting, running, now, devices)


class _Never(Policy):
    name = "never"

    def plan(self, waiting, running, now, devices):
        return Plan()


def test_patched_slo_drops_are_recorded_as_misses():
    # a needs 2 × 2.5 s alone but has 1 s: dropped on arrival. c alone: 1.5 + 4 = 5.5 s.
    trace = [SimRequest("a", 0.0, 512, 512, 2, slo_s=1.0), SimRequest("c", 1.0, 1024, 1024, 1, slo_s=50.0)]
    result = simulate(trace, make_policy(SchedulerConfig(policy="patched-slo"), HAND_COST), HAND_COST)
    assert result.records[0].dropped_at == 0.0 and result.records[0].first_step is None
    assert result.records[1].finish == pytest.approx(6.5)
    m = result.metrics()
    assert (m.dropped, m.finished, m.unfinished, m.slo_attainment) == (1, 1, 0, 0.5)


def test_a_plan_of_drops_only_is_followed_at_once_by_a_new_plan():
    trace = [SimRequest("a", 0.0, 512, 512, 2), SimRequest("b", 0.0, 512, 512, 2), SimRequest("c", 0.0, 1024, 1024, 1)]
    result = simulate(trace, _DropSmallOneAtATime(SchedulerConfig()), HAND_COST)
    assert [r.dropped_at for r in result.records] == [0.0, 0.0, None]
    assert times(result)["c"] == (0.0, pytest.approx(5.5))


def test_a_stalled_policy_leaves_requests_unfinished_not_lost():
    trace = [SimRequest("a", 0.0, 512, 512, 2, slo_s=50.0), SimRequest("c", 1.0, 1024, 1024, 1)]
    m = simulate(trace, _Never(SchedulerConfig()), HAND_COST).metrics()
    assert (m.unfinished, m.finished, m.dropped, m.slo_attainment) == (2, 0, 0, 0.0)


def test_orca_queues_less_than_fcfs_static_under_moderate_poisson_load():
    cost = linear_step_cost(per_forward_s=0.025, per_megapixel_s=0.08)
    requests = make_workload(WorkloadSpec(num_requests=400, rate=0.2, sizes=PATCHEDSERVE_SIZES, seed=0))
    fcfs = simulate(requests, policy("fcfs-static"), cost).metrics()
    orca = simulate(requests, policy("orca"), cost).metrics()
    assert fcfs.finished == orca.finished == 400
    assert 0.5 < orca.utilization < 0.9  # moderate: neither idle nor saturated
    assert orca.queueing_mean_s < 0.25 * fcfs.queueing_mean_s


@pytest.mark.slow
def test_ten_thousand_requests_all_finish():  # ~270k simulated steps, ~3.5 s on 2 cores
    cost = linear_step_cost(per_forward_s=0.025, per_megapixel_s=0.08)
    requests = make_workload(WorkloadSpec(num_requests=10_000, rate=0.2, sizes=PATCHEDSERVE_SIZES, seed=1))
    result = simulate(requests, policy("orca"), cost)
    assert result.metrics().finished == 10_000


# -- report --------------------------------------------------------------------------------

def test_report_dict_table_and_plot(tmp_path):
    rows = []
    for name in ("fcfs-static", "orca"):
        result = simulate(HAND_TRACE, policy(name), HAND_COST)
        data = json.loads(json.dumps(result_to_dict(result)))
        assert data["requests"][2]["finish"] == pytest.approx(15.5 if name == "fcfs-static" else 11.5)
        for scale in (1.0, 2.0):
            rows.append(summary_row(result, scale=scale))
    table = markdown_table(rows, ["policy", "scale", "latency_p50_s", "slo_attainment"])
    assert table.splitlines()[0] == "| policy | scale | latency_p50_s | slo_attainment |"
    assert "| orca | 1.000 | 9.500 | – |" in table
    plot_sweep(rows, "scale", "latency_mean_s", tmp_path / "sweep.png", title="hand trace")
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert not math.isnan(rows[0]["latency_mean_s"])
