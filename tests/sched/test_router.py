from gouache.sched.router import (
    LeastRequestsRouter, LeastTokensRouter, MaskAwareRouter, ReplicaLoad, RoundRobinRouter, RouteRequest,
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
