"""TetriServe's group knapsack (Algorithm 1, lines 13-22): one option per request, at most N
devices in all, the most surviving requests. Pure Python: no torch.

`Knapsack` adds one group at a time, so a planner can stop adding once no later group can
change the optimum (`saturated`, `improves`); `group_knapsack` is the DP over a list.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from gouache.sched.rounds import RoundOption


class Knapsack:
    """Algorithm 1's DP (lines 13-22), one group at a time: `add` each request's options in
    order, then `choice`. `dp[c]` is the best value with exactly c devices used (-1:
    unreachable); `back[i][c]` the option group i took to reach c."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.dp = [0] + [-1] * capacity
        self.back: list[list[int]] = []
        self.groups: list[Sequence[RoundOption]] = []
        self._improves: dict[tuple[int, int], bool] = {}  # (width, value) -> improves(width, value), while dp stays

    def add(self, options: Sequence[RoundOption], weight: int = 1) -> bool:
        """One more group, each surviving option worth `weight`; whether `dp` changed. Each
        capacity sees the options in order, so the first best is kept."""
        if not options:
            raise ValueError("every group needs at least one option (e.g. a width-0 'none')")
        capacity, dp = self.capacity, self.dp
        nxt, pick = [-1] * (capacity + 1), [-1] * (capacity + 1)
        for j, o in enumerate(options):
            w, v = o.degree, weight if o.survives else 0  # its width and value, as plain attributes
            for c in range(w, capacity + 1):
                count = dp[c - w]
                if count >= 0 and count + v > nxt[c]:
                    nxt[c], pick[c] = count + v, j
        self.back.append(pick)
        self.groups.append(options)
        changed, self.dp = nxt != dp, nxt
        if changed:
            self._improves = {}
        return changed

    def improves(self, width: int, value: int) -> bool:
        """Whether an option this wide worth `value` would change `dp`: some capacity c >= width
        with dp[c - width] >= 0 holds less than dp[c - width] + value. A group whose first option
        is a "none" worth nothing, and none of whose others improves `dp`, picks "none" at
        every reachable capacity and changes nothing."""
        key = (width, value)
        found = self._improves.get(key)
        if found is None:
            found = False
            for above, below in zip(self.dp[width:], self.dp):
                if below >= 0 and above - below < value:
                    found = True
                    break
            self._improves[key] = found
        return found

    def saturated(self, weight: int, widths: Sequence[int], valued: Collection[int] = ()) -> bool:
        """Whether no group whose options besides "none" are as wide as one of `widths` (all
        >= 1), those worth anything worth at most `weight` and as wide as one of `valued`, can
        change `dp`: every such option, at every capacity it reaches, is no better than what is
        there. Such a group picks its first option ("none", width 0) at every reachable
        capacity, so leaving it out changes neither the optimum nor which choice `choice`
        returns, and `dp` stays as it is for the next."""
        return not any(self.improves(w, weight if w in valued else 0) for w in widths)

    def choice(self) -> list[int]:
        """The index of the option chosen in each group: the most value, then the least total
        width (c* is the first argmax)."""
        dp = self.dp
        c = max(range(self.capacity + 1), key=lambda c: (dp[c], -c))
        if dp[c] < 0:
            raise ValueError(f"no choice fits in capacity {self.capacity}: some group has no option that narrow")
        choice = [0] * len(self.groups)
        for i in reversed(range(len(self.groups))):
            choice[i] = self.back[i][c]
            c -= self.groups[i][choice[i]].width
        return choice


def group_knapsack(groups: Sequence[Sequence[RoundOption]], capacity: int,
                   weights: Sequence[int] | None = None) -> list[int]:
    """Algorithm 1, lines 13-22: the index of the option chosen in each group.

    Exactly one option per group is chosen (give each a width-0 "none" to allow skipping), the
    widths sum to at most `capacity`, and the number of surviving options is maximal (each
    counted `weights[i]` times, where given: service tiers); among maximal choices the total
    width is least (c* is the first argmax). O(R x N x |O|) time, O(R x N) for the
    back-pointers.
    """
    knapsack = Knapsack(capacity)
    for i, options in enumerate(groups):
        knapsack.add(options, 1 if weights is None else weights[i])
    return knapsack.choice()
