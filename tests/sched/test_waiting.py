"""The scheduler's waiting queue keeps its orders as requests join and leave: queue order, and
per shape (tier, resolution, steps, steps done) deadline order, ties in queue order."""

import math
import random

from gouache.sched.tiers import queue_order
from gouache.sched.waiting import WaitingQueue, shape

from .factories import make_state


def test_orders_follow_joins_leaves_and_rejoins():
    rng = random.Random(5)
    queue, joined = WaitingQueue(), []  # joined: ids in the order they (last) joined
    for step in range(400):
        if queue and rng.random() < 0.4:
            rid = rng.choice(list(queue))
            if rng.random() < 0.5:
                state = queue.pop(rid)
                joined.remove(rid)
                if rng.random() < 0.5:  # a paused request comes back with a step more done
                    state.steps_done += 1
                    queue[rid] = state
                    joined.append(rid)
            else:
                del queue[rid]
                joined.remove(rid)
            continue
        rid = f"r{step}"
        state = make_state(rid, resolution=rng.choice([(256, 256), (512, 512)]), steps=rng.choice([4, 10]),
                           arrival=float(rng.randint(0, 5)))
        state.tier, state.fair_tag = rng.randint(0, 2), float(rng.randint(0, 3))
        state.deadline = None if rng.random() < 0.3 else float(rng.randint(0, 8))
        queue[rid] = state
        joined.append(rid)
        rank = {rid: i for i, rid in enumerate(joined)}
        expected = sorted((queue[r] for r in joined), key=lambda s: (*queue_order(s), rank[s.request_id]))
        assert [s.request_id for s in queue.ordered] == [s.request_id for s in expected]
        groups = {}
        for s in expected:
            groups.setdefault(shape(s), []).append(s)
        assert set(queue.ordered.classes) == set(groups)
        for key, members in groups.items():
            by_deadline = sorted(members, key=lambda s: math.inf if s.deadline is None else s.deadline)  # stable
            assert [s.request_id for s in queue.ordered.classes[key].states] == [s.request_id for s in by_deadline]
    assert list(queue) == joined and len(queue) == len(joined)
