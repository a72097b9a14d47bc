"""The video experiment (`gouache.sim.exp_video`): clips of a measured parallel cost model on a
pool of devices, SLO attainment of every profiled fixed degree and of round-knapsack."""

import json

import pytest

from gouache.sched.parallel_costmodel import ParallelCostModel
from gouache.sim.exp_video import VideoSetup, video_experiment
from gouache.sim.workloads import SimRequest, WorkloadSpec, make_workload

# a short clip that two devices barely speed up, a long one that they halve
COSTS = {(32, 32, 5): {1: 0.10, 2: 0.09}, (32, 48, 33): {1: 0.40, 2: 0.20}}


def profile(path, table=COSTS):
    data = ParallelCostModel(table, source="test").to_json()
    path.write_text(json.dumps({**data, "handoff": {"fixed_s": 0.001, "per_megapixel_s": 0.01, "source": "test"}}))
    return path


def test_clips_are_drawn_by_frames_and_priced_by_their_own_standalone_latency():
    spec = WorkloadSpec(40, 1.0, sizes=[(32, 32, 5), (48, 32, 33)], steps=4, slo_scale=2.0, seed=0)
    requests = make_workload(spec, lambda width, height, steps, frames=1: steps * frames * 0.01)
    assert {r.resolution for r in requests} == {(32, 32, 5), (32, 48, 33)}
    assert all(r.slo_s == pytest.approx(2.0 * 4 * r.frames * 0.01) for r in requests)
    assert SimRequest("c", 0.0, 48, 32, 4, frames=9).pixels == 48 * 32 * 9


def test_the_experiment_sweeps_slo_scales_for_every_profiled_degree_and_the_round_planner(tmp_path):
    setup = VideoSetup(num_devices=8, num_requests=80, slo_scales=(1.0, 3.0), seeds=(0,))
    data = video_experiment(tmp_path / "out", profile(tmp_path / "p.json"), setup)
    policies = {p["policy"] for p in data["points"]}
    assert policies == {"fixed-sp-1", "fixed-sp-2", "round-knapsack", "round-knapsack, free hand-off"}
    assert data["clips"] == ["32x32x5", "48x32x33"] and data["handoff"]["fixed_s"] == 0.001
    sar = {(p["slo_scale"], p["policy"]): p["slo_attainment"] for p in data["points"]}
    assert all(0 <= v <= 1 for v in sar.values())
    assert all(sar[3.0, p] >= sar[1.0, p] for p in policies)  # looser deadlines are met at least as often
    assert (tmp_path / "out" / "video.md").read_text().startswith("# Video: SLO attainment")
    assert (tmp_path / "out" / "video.png").exists()


def test_a_cost_model_without_clips_is_refused(tmp_path):
    with pytest.raises(ValueError, match="prices no clips"):
        video_experiment(tmp_path, profile(tmp_path / "p.json", {(64, 64): {1: 0.1}}))
