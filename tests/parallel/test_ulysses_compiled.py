"""Ulysses under --compile: a DiT's step of degree 2 on two worker processes runs in the
family's compiled pieces on each rank's shard (`gouache.runner.pieces.Shard`), the attention
between pieces over the group, the pieces' graphs compiled at warm-up (`Rehearsal`), segmented
adapters bound by the shard's layout; a step the pieces cannot take (past the row buckets) runs
eagerly, the Ulysses processors installed. Both equal one eager device."""

import pytest

from gouache.config import CompileConfig
from gouache.executor.multiproc import MultiprocExecutor
from gouache.executor.worker import WorkerSpec
from gouache.models.zoo import load_pipeline
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from tests.lora.random_files import random_loras
from tests.parallel.test_cfg import STEPS, compiled_adapters_split, steps

pytestmark = pytest.mark.slow


def load(count: int) -> list:
    return [(ImageRequest(f"r{i}", "a red circle", 64, 64, STEPS, 4.0 + i, seed=i), {}) for i in range(count)]


@pytest.mark.parametrize("model, fits", [("tiny-sd3", 2), ("tiny-flux", 4)])  # SD3's requests take 2 rows (CFG)
def test_a_ulysses_step_runs_in_compiled_pieces_on_each_rank_shard(model, fits):
    """Through dynamo's `eager` backend (the graphs' paths without inductor's code)."""
    runner = ModelRunner(load_pipeline(model))
    alone = {n: steps(runner, load(n))[0] for n in (fits, fits + 1)}
    spec = WorkerSpec(model, torch_threads=1, compile=CompileConfig(enabled=True, buckets=(4,), sizes=((64, 64),),
                                                                    backend="eager"))
    executor = MultiprocExecutor(spec, 2)
    try:
        compiles = {n: [] for n in alone}
        split = {n: steps(runner, load(n), executor, compiles=compiles[n]) for n in alone}
    finally:
        executor.shutdown()
    # the shard's graphs came from the warm-up: no step compiled one
    assert [(c.compiled, c.eager, c.recompiles) for c in compiles[fits]] == [(1, {}, 0)] * (2 * STEPS)
    # past the row bucket (4): eagerly, the Ulysses processors installed
    assert [(c.compiled, c.eager) for c in compiles[fits + 1]] == [(0, {"rows": 1})] * (2 * STEPS)
    for n, (latents, collectives) in split.items():
        assert all(s > 0 for s in collectives)  # the attention went over the group
        for rid, x in latents.items():
            assert (x - alone[n][rid]).abs().max() <= 1e-4, (n, rid)


def test_a_ulysses_step_with_segmented_adapters_runs_in_the_shards_pieces_and_equal(tmp_path):
    """The pieces take segmented adapters by their layout (`RowSlots.tokens`: each shard row's
    forward row): such a step runs compiled, its graph compiled when first met (counted, as a
    row graph's with adapters is), and equals one device."""
    model = "tiny-sd3"
    alone, split, modes, compiles = compiled_adapters_split(model, random_loras(tmp_path, model), 8)
    assert modes == ["segmented"] * STEPS
    assert [(c.compiled, c.eager) for c in compiles] == [(1, {})] * (2 * STEPS)
    assert [c.recompiles > 0 for c in compiles] == [True, True] + [False] * (2 * STEPS - 2)
    for rid in alone:
        assert (alone[rid] - split[rid]).abs().max() <= 1e-4, rid
