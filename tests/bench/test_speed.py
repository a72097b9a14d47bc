"""`gouache bench speed` (eager only here: compiling is slow on 2 cores; the compiled path is
tests/runner/test_compiled.py's): every row is measured on its own path, and the table shows
every ratio."""

import argparse

from gouache.bench.speed import add_arguments, format_table, measure


def test_every_row_and_ratio_is_measured_and_tabled():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--variants", "eager", "--size", "64", "--template-size", "64", "--batches", "1",
                              "--repeats", "1"])
    result = measure("tiny-sd", args)
    steps = result["steps"]
    assert set(steps) == {"step b=1", "patched", "grouped", "patched, segmented LoRA", "patched, no LoRA", "no LoRA",
                          "merged LoRA", "segmented LoRA", "ControlNet", "no ControlNet", "block cache", "exact",
                          "template edit", "full edit"}
    assert all(row["eager"]["ms"] > 0 and row["eager"]["paths"] == {} for row in steps.values())  # no compile: no paths
    ratios = result["ratios"]["eager"]
    assert set(ratios) == {"patched / grouped", "merged LoRA / none", "segmented LoRA / none",
                           "segmented LoRA / none, patched", "ControlNet / none", "block cache / exact",
                           "template edit / full edit"}
    table = format_table({"tiny-sd": result}, ["eager"])
    assert all(f"| tiny-sd | {name} |" in table for name in ratios)


def test_a_mask_outside_zero_to_one_and_a_graph_budget_without_compiling_are_refused():
    import pytest

    from gouache.bench.speed import run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for mask in ("0", "-0.2", "1.5"):
        with pytest.raises(ValueError, match="--mask"):
            run(parser.parse_args(["--mask", mask]))
    with pytest.raises(ValueError, match="--compile-graphs"):  # no compiled variant to bound
        run(parser.parse_args(["--variants", "eager", "--compile-graphs", "4"]))
