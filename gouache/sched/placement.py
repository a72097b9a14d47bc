"""GPU placement with placement preservation (TetriServe §4.2.3).

Every request gets an aligned block of devices: degree k sits on [a*k, (a+1)*k). Aligned blocks
keep the number of communication groups small (2N - 1 of them, the buddy blocks, instead of
every subset) and keep pairs on the links that pair devices (the paper's A40 nodes). Placing
the largest degree first, the free space is always a union of free aligned blocks of the
current size, so any set of power-of-two degrees whose sum is at most N fits: preservation
never costs a request its place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def place(
    degrees: Mapping[str, int], previous: Mapping[str, Sequence[int]], num_devices: int
) -> dict[str, tuple[int, ...]]:
    """Device ids per request for this round.

    `degrees` maps request id -> power-of-two degree (their sum at most `num_devices`);
    `previous` maps request id -> the devices it ran on last round (missing = it did not run).
    A request whose degree is unchanged keeps its devices when they are free; no other request
    takes them unless every free block it could use overlaps them. A request whose degree
    changed gets the free block that overlaps its previous devices most (a scale-down keeps a
    subset, a scale-up a superset where it can), so its latent moves as little as possible.
    Ties go to the lowest block. O(R x N) for R placed requests.
    """
    _check(degrees, num_devices)
    reserved = {
        d: rid
        for rid, k in degrees.items()
        if _is_block(previous.get(rid, ()), k, num_devices)
        for d in previous[rid]
    }
    free = [True] * num_devices
    placed: dict[str, tuple[int, ...]] = {}
    for rid in sorted(degrees, key=lambda r: -degrees[r]):  # stable: equal degrees keep input order
        k, own = degrees[rid], set(previous.get(rid, ()))
        best: tuple[tuple[int, int, int], range] | None = None
        for start in range(0, num_devices - k + 1, k):
            if not all(free[start : start + k]):
                continue
            block = range(start, start + k)
            taken_from_others = sum(1 for d in block if reserved.get(d, rid) != rid) if reserved else 0
            key = (taken_from_others, -len(own.intersection(block)), start)
            if best is None or key < best[0]:
                best = (key, block)
        if best is None:  # impossible by the largest-first argument above
            raise RuntimeError(f"no free aligned block of {k} devices for {rid}")
        for d in best[1]:
            free[d] = False
        placed[rid] = tuple(best[1])
    return placed


def _is_block(devices: Sequence[int], k: int, num_devices: int) -> bool:
    """Whether `devices` is exactly an aligned block of size k inside [0, num_devices)."""
    if len(devices) != k or not devices:
        return False
    start = min(devices)
    return start % k == 0 and start + k <= num_devices and sorted(devices) == list(range(start, start + k))


def _check(degrees: Mapping[str, int], num_devices: int) -> None:
    for rid, k in degrees.items():
        if k < 1 or k & (k - 1) or k > num_devices:
            raise ValueError(f"{rid}: degree {k} must be a power of two between 1 and {num_devices}")
    if sum(degrees.values()) > num_devices:
        raise ValueError(f"degrees sum to {sum(degrees.values())} but only {num_devices} devices exist")
