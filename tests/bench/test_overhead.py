"""The decision-time benchmark times the whole table several times and reports the median."""

import statistics

import pytest

from gouache.bench.overhead import run_overhead


def test_each_cell_is_the_median_over_runs(tmp_path):
    data = run_overhead(tmp_path / "overhead.json", waiting=(10,), runs=3)
    assert data["runs"] == 3 and {row["policy"] for row in data["rows"]} >= {"fcfs-static", "round-knapsack (N=8)"}
    for row in data["rows"]:
        assert len(row["runs_ms"]) == 3 and row["median_ms"] == statistics.median(row["runs_ms"]) > 0
    assert "runs at 10: min-max" in (tmp_path / "overhead.md").read_text()


def test_at_least_one_run():
    with pytest.raises(ValueError, match="runs must be >= 1"):
        run_overhead("unused.json", waiting=(10,), runs=0)
