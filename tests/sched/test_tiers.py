"""Service tiers and tenants in the scheduler: every policy sees a higher tier first, a step
policy pauses a lower tier's running request for a waiting higher tier's (never within a
tier), a paused request resumes with its steps kept, and tenants of a tier share it by weight."""

import math

import pytest

from gouache.config import MAX_QUEUE_LEN, EngineConfig, SchedulerConfig
from gouache.request import RequestStatus, Tier
from gouache.sched.plan import Plan
from gouache.sched.policies import make_policy
from gouache.sched.scheduler import Scheduler
from gouache.sched.tiers import MAX_WEIGHT, MIN_WEIGHT, FairQueue, make_room, queue_order, tenant_limit

from .factories import groups, make_state, run_step
from .test_patched_slo import Linear

PRIORITY, DEFAULT, FLEX = (Tier.named(name) for name in ("priority", "default", "flex"))


def tiered(rid, tier, arrival=0.0, steps=4, tenant="", weight=1.0, resolution=(256, 256), deadline=None):
    state = make_state(rid, resolution=resolution, steps=steps, arrival=arrival)
    state.tier, state.tenant, state.weight, state.deadline = tier, tenant, weight, deadline
    return state


def patched_slo(max_batch: int, running) -> Scheduler:
    """patched-slo (Linear step costs) with `running` admitted and one step run."""
    s = Scheduler(make_policy(SchedulerConfig(policy="patched-slo", max_batch_size=max_batch), Linear()))
    s.add(running)
    run_step(s)
    return s


def test_tier_names_rank_in_order_and_an_unknown_one_names_the_tiers():
    assert (PRIORITY, DEFAULT, FLEX) == (0, 1, 2)
    assert [tier.label for tier in (PRIORITY, DEFAULT, FLEX)] == ["priority", "default", "flex"]
    with pytest.raises(ValueError, match="the tiers are priority, default, flex"):
        Tier.named("gold")


def test_make_room_pauses_only_for_a_higher_tier():
    running = [tiered("d", DEFAULT), tiered("f", FLEX)]
    # a priority request takes the flex request's slot; the default one keeps its own
    kept, admitted, paused = make_room([tiered("p", PRIORITY)], running, 2)
    assert ([s.request_id for s in kept], [s.request_id for s in admitted], paused) == (["d"], ["p"], ["f"])
    # a waiting request of the same tier never takes a running one's slot
    kept, admitted, paused = make_room([tiered("f2", FLEX)], running, 2)
    assert ([s.request_id for s in kept], admitted, paused) == (["d", "f"], [], [])
    # with room, nobody is paused
    kept, admitted, paused = make_room([tiered("p", PRIORITY)], running, 3)
    assert (len(kept), [s.request_id for s in admitted], paused) == (2, ["p"], [])


@pytest.mark.parametrize("policy", ["orca", "patched", "fcfs-static"])
def test_every_step_policy_admits_a_higher_tier_first(policy):
    s = Scheduler(make_policy(SchedulerConfig(policy=policy, max_batch_size=1)))
    s.add(tiered("flex", FLEX, arrival=0.0))
    s.add(tiered("default", DEFAULT, arrival=1.0))
    s.add(tiered("priority", PRIORITY, arrival=2.0))
    assert s.schedule(3.0).admit == ["priority"]


def test_a_paused_request_keeps_its_steps_and_resumes_after_the_higher_tier():
    s = Scheduler(make_policy(SchedulerConfig(policy="orca", max_batch_size=1)))
    s.add(tiered("flex", FLEX, steps=4))
    run_step(s)
    run_step(s)
    assert s.running["flex"].steps_done == 2
    s.add(tiered("priority", PRIORITY, steps=2, arrival=1.0))
    plan, _ = run_step(s, 1.0)
    assert plan.pause == ["flex"] and plan.admit == ["priority"] and groups(plan) == [["priority"]]
    paused = s.waiting["flex"]
    assert (paused.status, paused.steps_done, paused.pauses) == (RequestStatus.WAITING, 2, 1)
    _, finished = run_step(s, 1.5)
    assert finished == ["priority"]
    plan, _ = run_step(s, 2.0)  # the slot is free again: the flex request resumes where it stopped
    assert plan.admit == ["flex"] and s.running["flex"].steps_done == 3


def test_a_plan_that_pauses_what_it_runs_is_refused():
    class Bad:
        name, rounds = "bad", False
        min_devices, max_devices = 1, 1

        def plan(self, waiting, running, now, devices):
            rid = running[0].request_id
            return Plan(batches=make_policy(SchedulerConfig()).plan([], running, now, devices).batches, pause=[rid])

    s = Scheduler(make_policy(SchedulerConfig(policy="orca")))
    s.add(tiered("a", DEFAULT))
    run_step(s)
    s.policy = Bad()
    with pytest.raises(ValueError, match="paused a request that is not running, or ran one it paused"):
        s.schedule(1.0)


def test_patched_slo_pauses_a_lower_tier_and_ignores_its_deadline_for_a_higher_one():
    s = patched_slo(1, tiered("default", DEFAULT, steps=10, deadline=100.0))
    s.add(tiered("priority", PRIORITY, steps=10, arrival=0.1, deadline=5.0))
    plan, _ = run_step(s, 0.2)
    assert plan.pause == ["default"] and plan.admit == ["priority"]
    # with room for both, the default request's deadline (which the pair would miss) does not
    # stop the priority request; the same request of the default tier is stopped by it
    for tier, admitted in ((PRIORITY, ["late"]), (DEFAULT, [])):
        # alone: 10 steps x 0.15 s = 1.5 s; with another, 10 x 0.2 s = 2 s
        s = patched_slo(2, tiered("tight", DEFAULT, steps=10, deadline=1.55))
        s.add(tiered("late", tier, steps=10, arrival=0.01, deadline=50.0))
        plan, _ = run_step(s, 0.0)
        assert plan.admit == admitted and plan.pause == []


def test_tenants_of_a_tier_share_it_by_weight():
    """SFQ start tags: tenant a (weight 2) and b (weight 1), both with requests waiting, are
    served 2:1; c, idle until late, starts at the present with no credit saved up."""
    fair = FairQueue()
    states = [tiered(f"{tenant}{i}", DEFAULT, arrival=i, tenant=tenant, weight=weight)
              for tenant, weight in (("a", 2.0), ("b", 1.0)) for i in range(12)]
    for state in states:
        fair.tag(state)
    served = []
    waiting = sorted(states, key=queue_order)
    for _ in range(9):
        first = waiting.pop(0)
        fair.admitted(first)
        served.append(first.request_id[0])
    assert served.count("a") == 6 and served.count("b") == 3
    late = tiered("c0", DEFAULT, arrival=100.0, tenant="c")
    fair.tag(late)
    assert late.fair_tag == fair.clock[DEFAULT]  # the tier's present: ahead of a's and b's later requests
    assert sorted([*waiting, late], key=queue_order)[0] is late


def test_fair_order_never_crosses_tiers():
    fair = FairQueue()
    busy = [tiered(f"b{i}", PRIORITY, tenant="busy") for i in range(5)]
    other = tiered("o", DEFAULT, tenant="other")
    for state in [*busy, other]:
        fair.tag(state)
    assert sorted([other, *busy], key=queue_order)[-1] is other


def test_fixed_sp_takes_the_waiting_in_tier_order():
    s = Scheduler(make_policy(SchedulerConfig(policy="fixed-sp-1")), num_devices=1)
    s.add(tiered("default", DEFAULT))
    s.add(tiered("priority", PRIORITY, arrival=1.0))
    assert s.schedule(2.0).admit == ["priority"]


def test_round_knapsack_keeps_a_priority_deadline_over_an_earlier_default_one():
    """One device, two requests that each survive the round only if they run in it: by deadline
    the default one would run; a priority request's deadline outranks it."""
    from gouache.sched.knapsack import plan_round
    from gouache.sched.rounds import RoundRequest

    def step_time(resolution, degree):
        return 1.0 if degree == 1 else float("inf")

    for priority_tier, runs in ((DEFAULT, "early"), (PRIORITY, "late")):
        requests = [RoundRequest("early", (256, 256), 2, 2.5, DEFAULT), RoundRequest("late", (256, 256), 2, 2.6,
                                                                                      priority_tier)]
        decision = plan_round(requests, step_time, 1, 1.0, 0.0, run_late=False)
        assert list(decision.allocations) == [runs]
    # a survivor of a tier outranks every survivor of the tiers below it: on 2 devices, one
    # priority request that needs both runs rather than two default ones that need one each
    requests = [RoundRequest("p", (512, 512), 2, 2.1, PRIORITY), RoundRequest("d1", (256, 256), 2, 2.5, DEFAULT),
                RoundRequest("d2", (256, 256), 2, 2.5, DEFAULT)]

    def sized(resolution, degree):
        return (1.0 if degree == 2 else 2.0) if resolution == (512, 512) else 1.0

    assert list(plan_round(requests, sized, 2, 1.0, 0.0, run_late=False).allocations) == ["p"]


def test_a_tenant_holds_its_weights_share_of_a_tiers_places_while_others_hold_some():
    assert tenant_limit("a", 1.0, 16, {}) == 16 and tenant_limit("a", 1.0, 16, {"a": 1.0}) == 16  # alone: all
    assert tenant_limit("a", 1.0, 16, {"a": 1.0, "b": 1.0}) == 8
    assert tenant_limit("a", 2.0, 16, {"b": 1.0}) == 10 and tenant_limit("b", 1.0, 16, {"a": 2.0}) == 5
    assert tenant_limit("a", 1.0, 2, {f"t{i}": 1.0 for i in range(5)}) == 1  # never none


def test_a_tenants_share_is_an_int_in_its_tiers_places_at_the_ends_of_the_weight_range():
    """The weights a keys file may give, against any others and any queue length a server may
    have: an int in [1, limit] (a weight of 1e308, which no file may give now, overflowed)."""
    weights = (MIN_WEIGHT, 1.0, MAX_WEIGHT)
    crowds = [{}, *({"b": w} for w in weights), {f"t{i}": MAX_WEIGHT for i in range(1000)},
              {f"t{i}": MIN_WEIGHT for i in range(1000)}]
    for weight in weights:
        for others in crowds:
            for limit in (1, 64, MAX_QUEUE_LEN):
                share = tenant_limit("a", weight, limit, others)
                assert type(share) is int and 1 <= share <= limit
    assert tenant_limit("a", MAX_WEIGHT, MAX_QUEUE_LEN, {"b": MIN_WEIGHT}) == MAX_QUEUE_LEN - 1
    assert tenant_limit("a", MIN_WEIGHT, MAX_QUEUE_LEN, {"b": MAX_WEIGHT}) == 1
    assert tenant_limit("a", 2.0, 98, {"b": 47.0}) == 4  # exactly 4 places: not 3.9999999999999996


def test_fair_tags_stay_finite_and_ordered_by_weight_at_the_ends_of_the_range():
    fair = FairQueue()
    light = [tiered(f"l{i}", DEFAULT, tenant="light", weight=MIN_WEIGHT, steps=200, resolution=(2048, 2048))
             for i in range(3)]
    heavy = [tiered(f"h{i}", DEFAULT, tenant="heavy", weight=MAX_WEIGHT, resolution=(64, 64), steps=1)
             for i in range(3)]
    for state in [*light, *heavy]:
        fair.tag(state)
    assert all(math.isfinite(end) for end in fair.ends.values())
    assert [s.request_id for s in sorted([*light, *heavy], key=queue_order)][:4] == ["l0", "h0", "h1", "h2"]


@pytest.mark.parametrize("ms", [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 0.999, 1e9 + 1, 1e308, -1e308])
def test_a_tier_deadline_outside_the_range_is_refused(ms):
    with pytest.raises(ValueError, match=r"tier_slo_ms of priority must be in \[1, 1e\+09\] ms"):
        SchedulerConfig(policy="patched-slo", tier_slo_ms=(("priority", ms),))


@pytest.mark.parametrize("share", [math.nan, math.inf, -0.0, 0.0, 1e308, -1e308, 1.0000001])
def test_a_tier_share_outside_the_range_is_refused(share):
    with pytest.raises(ValueError, match=r"tier_queue_share of flex must be in \(0, 1\]"):
        EngineConfig(tier_queue_share=(("flex", share),))


def test_make_room_ranks_only_the_head_of_the_queue_and_chooses_as_ranking_everyone():
    """In queue order only the first `capacity` waiting requests can be chosen: the result is
    that of ranking every request (tier, running first, order)."""
    import random

    rng = random.Random(3)
    for _ in range(300):
        waiting = sorted((make_state(f"w{i}") for i in range(rng.randint(0, 30))), key=lambda s: s.request_id)
        for state in waiting:
            state.tier = rng.randint(0, 2)
        waiting.sort(key=lambda s: s.tier)  # queue order is tier first
        running = [make_state(f"r{i}") for i in range(rng.randint(0, 6))]
        for state in running:
            state.tier = rng.randint(0, 2)
        running.sort(key=lambda s: s.tier)
        capacity = rng.randint(1, 8)
        ranked = sorted([*((s.tier, 0, i, s) for i, s in enumerate(running)),
                         *((s.tier, 1, i, s) for i, s in enumerate(waiting))], key=lambda e: e[:3])
        chosen = {id(e[3]) for e in ranked[:capacity]}
        expected = ([s for s in running if id(s) in chosen], [s for s in waiting if id(s) in chosen],
                    [s.request_id for s in running if id(s) not in chosen])
        assert make_room(waiting, running, capacity) == expected


def test_an_arrival_is_refused_past_its_tiers_limit_then_past_its_tenants_share():
    from gouache.sched.tiers import Refusal, refusal

    flight = [(0, "a", 1.0), (1, "a", 1.0), (1, "a", 1.0), (1, "b", 1.0), (2, "b", 1.0)]
    assert refusal(1, "a", 1.0, 1, flight, limit=4) == Refusal(4, 4)  # priority's and default's 4 fill it
    # default's 5 places, two tenants in it: 2 each, and "a" holds 2
    assert refusal(1, "a", 1.0, 1, flight, limit=5) == Refusal(2, 2, tenant_share=True, others=1)
    assert refusal(1, "b", 1.0, 1, flight, limit=5) is None
    assert refusal(1, "c", 1.0, 1, flight, limit=9) is None  # a third tenant's share: 9 // 3 = 3, it holds none
    assert refusal(2, "b", 1.0, 1, flight, limit=8) is None  # alone in flex: all of it
