import pytest

from gouache.sched.router import (
    LeastRequestsRouter,
    LeastTokensRouter,
    MaskAwareRouter,
    MeasuredEditCost,
    ReplicaLoad,
    RoundRobinRouter,
    RouteRequest,
)


def req(rid="r", pixels=1024 * 1024, steps=20, mask=1.0):
    return RouteRequest(rid, pixels, steps, mask)


def test_round_robin_cycles():
    router = RoundRobinRouter()
    replicas = [ReplicaLoad() for _ in range(3)]
    assert [router.route(req(), replicas) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_least_requests_and_least_tokens_disagree_when_masks_differ():
    small_edits = ReplicaLoad(running=[req(mask=0.1), req(mask=0.1)])  # 2 requests, 0.2 MP masked
    one_generation = ReplicaLoad(running=[req()])  # 1 request, 1 MP
    replicas = [small_edits, one_generation]
    assert LeastRequestsRouter().route(req(), replicas) == 1
    assert LeastTokensRouter().route(req(), replicas) == 0


def test_mask_aware_uses_the_batch_cost_model():
    # per-step cost: fixed 10 ms + 4 ms per masked megapixel
    router = MaskAwareRouter(lambda batch: 0.010 + sum(r.pixels * r.mask_ratio for r in batch) * 4e-9)
    light = ReplicaLoad(running=[req(mask=0.1)] * 3)
    heavy = ReplicaLoad(running=[req()])
    assert router.cost(req(mask=0.1), light) < router.cost(req(mask=0.1), heavy)
    assert router.route(req(mask=0.1), [heavy, light]) == 1


def test_mask_aware_counts_the_wait_for_a_slot():
    router = MaskAwareRouter(lambda batch: 0.01 * len(batch))
    full = ReplicaLoad(running=[req(steps=4), req(steps=10)], waiting=[req()], max_batch=2)
    free = ReplicaLoad(running=[req(steps=10)], max_batch=2)
    # full: it needs the 2nd slot, free when the 10-step request ends: 10 steps of 0.02 s = 0.2 s,
    # then its 20 steps in a batch of two (0.02 s each)
    assert abs(router.cost(req(), full) - (0.2 + 0.4)) < 1e-9
    assert abs(router.cost(req(), free) - 0.4) < 1e-9
    assert router.route(req(), [full, free]) == 1


def test_mask_aware_handles_a_queue_in_front_of_an_empty_batch():
    router = MaskAwareRouter(lambda batch: 0.01 * len(batch))
    idle_with_queue = ReplicaLoad(waiting=[req()], max_batch=2)
    assert abs(router.cost(req(), idle_with_queue) - 20 * 0.02) < 1e-9


def mask_model(per_step_s: float, per_gflop_s: float, text_tokens: int = 0):
    """A measured template-edit model by hand: a step costs per_step_s + per_gflop_s per GFLOP
    (InstGenIE Table 1's FLOPs, 2 blocks of width 64); loading is free."""
    from gouache.sched.costmodel import MaskCostModel
    from gouache.sched.predictors import LinearPredictor

    def line(intercept, slope):
        return LinearPredictor.from_json({"kind": "linear", "coef": [slope], "intercept": intercept})

    return MaskCostModel(64, 2, compute=line(per_step_s, per_gflop_s * 1e-9), load=line(0.0, 0.0),
                         text_tokens=text_tokens)


def test_measured_edit_cost_prices_tokens_rows_and_masks_with_the_model():
    model = mask_model(0.01, 1.0)
    cost = MeasuredEditCost(model, token_pixels=16, rows=2)
    batch = [req(pixels=256 * 256, mask=0.2), req(pixels=128 * 128)]
    # 256 px: 256 tokens at 0.2, twice (CFG rows); 128 px: 64 tokens, whole
    assert cost(batch) == model.predict([(256, 0.2), (256, 0.2), (64, 1.0), (64, 1.0)])
    assert cost([req(pixels=256 * 256, mask=0.1)]) < cost([req(pixels=256 * 256, mask=0.5)])


def test_a_measured_model_whose_cost_is_its_text_rows_routes_by_requests_where_the_stand_in_counts_pixels():
    from gouache.sim.costs import linear_step_cost

    # 64 image tokens against 288 text rows, as shapes-dit at 128 px: masks hardly move a step
    measured = MaskAwareRouter(MeasuredEditCost(mask_model(0.0, 1.0, text_tokens=288), token_pixels=16))
    stand_in = MaskAwareRouter(linear_step_cost(per_megapixel_s=1.0).batch_step_time)
    small_edits = ReplicaLoad(running=[req(pixels=128 * 128, mask=0.1)] * 2)
    one_generation = ReplicaLoad(running=[req(pixels=128 * 128)])
    new = req(pixels=128 * 128, mask=0.1)
    assert stand_in.route(new, [small_edits, one_generation]) == 0  # 0.3 of an image's pixels against 1.1
    assert measured.route(new, [small_edits, one_generation]) == 1  # three requests' text rows against two


def test_mask_aware_lets_a_queued_request_take_a_free_slot():
    # one running and one routed a moment ago (queued until the next step) is a batch of two with
    # six free slots, as two running are: the new request joins either at the next step
    router = MaskAwareRouter(lambda batch: 0.01 * len(batch))
    just_routed = ReplicaLoad(running=[req(steps=20)], waiting=[req()])
    two_running = ReplicaLoad(running=[req(steps=20), req()])
    assert router.cost(req(), just_routed) == router.cost(req(), two_running) == 20 * 0.03
    # taken as queued, it would wait 20 + 20/8 steps of a batch of one for a slot that is free,
    # then run alone: a wrong price either way (here too low)
    assert router.latency(req(), just_routed) == pytest.approx(22.5 * 0.01 + 20 * 0.01)
    assert just_routed.admitted() == two_running
