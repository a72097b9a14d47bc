"""The plan a policy returns for one engine step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepPlan:
    """Which requests denoise this step, and how they are grouped into forward passes."""

    groups: list[list[str]] = field(default_factory=list)  # [num_forwards][reqs] request ids sharing one forward
    admit: list[str] = field(default_factory=list)  # waiting request ids that start running with this step
    patched: bool = False  # groups may mix latent shapes: run them through the patch layout
    drop: list[str] = field(default_factory=list)  # waiting request ids that cannot meet their deadline

    @property
    def request_ids(self) -> list[str]:
        return [rid for group in self.groups for rid in group]

    def __bool__(self) -> bool:
        return bool(self.groups or self.drop)
