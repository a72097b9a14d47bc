"""--max-batch-size auto (`gouache.runner.batch_probe`): the batch grows while the time per image
falls by 10 % as it doubles, stops at the step budget, and leaves no request behind."""

import pytest

from gouache.models.zoo import load_pipeline
from gouache.runner.batch_probe import probe_max_batch
from gouache.runner.model_runner import ModelRunner


class Runner:
    """What the probe uses of a runner: prepare, release."""

    def __init__(self):
        self.states = {}

    def prepare(self, request):
        self.states[request.request_id] = request

    def release(self, request_id):
        self.states.pop(request_id)


@pytest.mark.parametrize(("cost", "expected"), [
    (lambda n: 0.01 + 0.001 * n, 64),  # overhead-bound: batching pays up to the limit
    (lambda n: 0.01 * n, 1),  # compute-bound from the start: nothing pays
    (lambda n: 0.02 + 0.01 * n, 16),  # per image 30, 20, 15, 12.5, 11.25, 10.6 ms: 32 gains only 6 %
    (lambda n: 0.3 + 0.3 * n, 4),  # 4 still pays but its step (1.5 s) is past the budget: no 8
])
def test_the_batch_doubles_while_it_pays_and_within_the_step_budget(cost, expected):
    runner = Runner()
    probe = probe_max_batch(runner, (64, 64), 4.0, step_s=lambda r, ids: cost(len(ids)))
    assert probe.max_batch == expected
    assert not runner.states  # every probe request released


def test_the_probe_runs_real_steps_and_says_what_it_measured():
    runner = ModelRunner(load_pipeline("tiny-sd"))
    probe = probe_max_batch(runner, (64, 64), 4.0, limit=4)
    assert probe.max_batch in (1, 2, 4) and set(probe.step_s) <= {1, 2, 4} and 1 in probe.step_s
    assert not runner.states
    assert "max batch size" in probe.describe()


def test_default_compile_buckets_grow_to_cover_the_largest_batch():
    from gouache.config import COMPILE_BUCKETS, CompileConfig
    from gouache.engine.build import cover

    on = CompileConfig(enabled=True)
    assert cover(on, 16, 2).buckets == (*COMPILE_BUCKETS, 32)  # 16 requests with CFG rows
    assert cover(on, 4, 2).buckets == COMPILE_BUCKETS
    assert cover(CompileConfig(enabled=True, buckets=(2, 4)), 16, 2).buckets == (2, 4)  # the operator's own
    assert cover(CompileConfig(), 16, 2) == CompileConfig()  # not compiling
