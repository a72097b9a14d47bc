"""The one kind of plan every policy returns: batches of requests on device groups, for some steps.

Step-level continuous batching (orca, patched, ...) is the case "one step, one device": each
forward of the step is a `Batch` on device 0 run once. A TetriServe round is "q steps, several
groups": each request (or selective batch) runs its steps on an aligned block of devices, the
block's size being its sequence-parallel degree. Batches on disjoint device groups run at the
same time; batches on the same group run one after the other, in plan order.

A plan with `until` is a round: when that time passes, every batch stops at its next step
boundary, and the next plan is made once all have stopped (or sooner, when all are done).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Batch:
    """One forward pass over `request_ids`, run `steps` times back to back on `devices`.

    A member with fewer steps left than `steps` leaves the batch when it finishes; the rest go
    on. `devices` is an aligned block (degree k sits on [a*k, (a+1)*k)); its length is the
    sequence-parallel degree of every member."""

    request_ids: tuple[str, ...]
    devices: tuple[int, ...] = (0,)
    steps: int = 1
    patched: bool = False  # members may have different resolutions: one patched / packed forward

    def __post_init__(self) -> None:
        if not self.request_ids:
            raise ValueError("a batch needs at least one request")
        if self.steps < 1:
            raise ValueError(f"a batch runs at least one step, got {self.steps}")
        k = len(self.devices)
        if k < 1 or k & (k - 1) or self.devices != tuple(range(self.devices[0], self.devices[0] + k)) \
                or self.devices[0] % k:
            raise ValueError(f"devices {self.devices} are not an aligned power-of-two block")

    @property
    def degree(self) -> int:
        return len(self.devices)


@dataclass
class Plan:
    """A policy's decision at one moment. Every id in `admit` is in some batch; ids in `drop`
    are waiting requests that cannot meet their deadline and leave with an error."""

    batches: list[Batch] = field(default_factory=list)
    admit: list[str] = field(default_factory=list)  # waiting ids that start running with this plan
    drop: list[str] = field(default_factory=list)  # waiting ids dropped as unattainable
    # running ids that give their slot to a higher tier: back to waiting, their latents kept
    pause: list[str] = field(default_factory=list)
    until: float | None = None  # a round's end on the caller's clock; None: each batch runs all its steps

    @property
    def request_ids(self) -> list[str]:
        return [rid for batch in self.batches for rid in batch.request_ids]

    def __bool__(self) -> bool:
        return bool(self.batches or self.drop or self.pause)


def one_step(groups: list[list[str]], admit: list[str], patched: bool = False, drop: list[str] | None = None,
             pause: list[str] | None = None) -> Plan:
    """A step policy's plan: each group one forward on device 0, run once, in order."""
    return Plan(batches=[Batch(tuple(g), steps=1, patched=patched) for g in groups if g], admit=admit, drop=drop or [],
                pause=pause or [])
