"""What every trainer shares: seeded batches of shapes, the optimisation loop with a progress bar
and an exponential moving average, and the loss-curve report.

A run may be data-parallel over several processes (`gouache train --workers`): each draws its own
share of every batch and the gradients are averaged over them before each optimiser step, so all
processes hold the same weights throughout and the first one writes them."""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from gouache.data.shapes import Scene, caption, layout_map, render, sample_scene


@dataclass(frozen=True)
class Batch:
    """One training batch: images of one size, in [-1, 1], with their captions."""

    pixels: torch.Tensor  # [B, 3, H, W] float32
    captions: list[str]
    layouts: torch.Tensor | None = None  # [B, 3, H, W] in [0, 1]: each scene's `layout_map`, if asked


def process_group() -> tuple[int, int]:
    """(this process's rank, number of processes) of the run: (0, 1) unless data-parallel."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_writer() -> bool:
    """Whether this process writes the run's weights and report (the first one)."""
    return process_group()[0] == 0


def batch_share(name: str, seed: int, step: int, batch: int) -> tuple[random.Random, int]:
    """(the random numbers of this process's share of batch `step` of run `seed` of `name`, the
    share's size): the same for the same (name, seed, step, rank, processes)."""
    rank, world = process_group()
    if batch % world:
        raise ValueError(f"a batch of {batch} does not split over {world} processes")
    return random.Random(f"{name}:{seed}:{step}" + (f":{rank}/{world}" if world > 1 else "")), batch // world


def shapes_batch(
    seed: int, step: int, batch: int, sizes: tuple[tuple[int, int], ...], device: torch.device | str = "cpu",
    restyle: Callable[[Scene], Scene] | None = None, captioned: Callable[[Scene], str] = caption,
    layouts: bool = False,
) -> Batch:
    """This process's share of batch `step` of run `seed`, on `device`: one size drawn from `sizes`,
    and `batch` / processes fresh scenes at that size, captioned by `captioned`, drawn restyled
    by `restyle`, with their layout maps if `layouts`. It depends on (seed, step, rank,
    processes) alone, so a run can be replayed."""
    rng, share = batch_share("train", seed, step, batch)
    width, height = rng.choice(sizes)
    scenes = [sample_scene(rng) for _ in range(share)]
    drawn = scenes if restyle is None else [restyle(s) for s in scenes]  # captioned as `scenes`, drawn as this
    seeds = [rng.getrandbits(32) for _ in drawn]
    images = np.stack([render(s, width, height, seed=k) for s, k in zip(drawn, seeds)])
    pixels = torch.from_numpy(images).to(device).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    maps = None
    if layouts:
        maps = np.stack([layout_map(s, width, height, seed=k) for s, k in zip(drawn, seeds)])
        maps = torch.from_numpy(maps).to(device).permute(0, 3, 1, 2).float() / 255.0
    return Batch(pixels, [captioned(s) for s in scenes], maps)


def flow_sigmas(n: int, shift: float, generator: torch.Generator, device: str) -> torch.Tensor:
    """n noise levels of a flow model's training: logit-normal (SD3's), then shifted as the
    sampler shifts its schedule, `shift` u / (1 + (`shift` - 1) u). At the sampler's shift 3 few
    draws fall low (0.7 % below 0.2, 13.6 % below 0.5); at 1, 8.3 % and 50 %."""
    u = torch.sigmoid(torch.randn(n, generator=generator, device=device))
    return shift * u / (1 + (shift - 1) * u)


@dataclass
class Schedule:
    """The optimiser's settings for one run."""

    steps: int
    lr: float
    warmup: int = 200  # linear warm-up steps
    final_lr_fraction: float = 0.1  # cosine decay ends at lr * this
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    ema_decay: float | None = 0.999  # None: keep the last weights

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(self.steps - self.warmup, 1)
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return self.lr * (self.final_lr_fraction + (1 - self.final_lr_fraction) * cosine)


@dataclass
class Report:
    """What a run measured: its losses (one per step) and wall time."""

    name: str
    seed: int
    schedule: dict
    params: int
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def smoothed(self, window: int = 50) -> list[float]:
        values = np.asarray(self.losses)
        if len(values) < window:
            return values.tolist()
        return np.convolve(values, np.ones(window) / window, mode="valid").tolist()

    def write(self, directory: Path, command: str) -> tuple[Path, Path]:
        """`train_<name>.json` (losses smoothed, settings, time, command) and `train_<name>.png`."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        directory.mkdir(parents=True, exist_ok=True)
        smooth = self.smoothed()
        json_path, png_path = directory / f"train_{self.name}.json", directory / f"train_{self.name}.png"
        summary = {k: v for k, v in asdict(self).items() if k != "losses"}
        summary.update(
            command=command, steps=len(self.losses), minutes=round(self.seconds / 60, 2),
            final_loss=smooth[-1] if smooth else None, loss_smoothed_every_50=smooth[::50],
        )
        json_path.write_text(json.dumps(summary, indent=1) + "\n")
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(self.losses, alpha=0.25, lw=0.5, label="per step")
        ax.plot(range(len(self.losses) - len(smooth), len(self.losses)), smooth, lw=1.5, label="mean of 50")
        ax.set(xlabel="step", ylabel="loss", yscale="log",
               title=f"gouache train: {self.name} ({self.seconds / 60:.1f} min)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(png_path, dpi=110)
        plt.close(fig)
        return json_path, png_path


def train(
    name: str, model: torch.nn.Module, loss_of: Callable[[int], torch.Tensor], schedule: Schedule, seed: int,
    start: int = 0,
) -> tuple[torch.nn.Module, Report]:
    """Minimise `loss_of(step)` over `model`'s parameters for `schedule.steps` steps from data step
    `start` (a resumed run's: the batches a longer run would have drawn next; the learning rate's
    warm-up and decay are this run's own); returns the weights to keep (the moving average where
    the schedule has one) and the report."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimiser = torch.optim.AdamW(params, lr=schedule.lr, weight_decay=schedule.weight_decay)
    ema = None
    if schedule.ema_decay is not None:
        ema = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(schedule.ema_decay)
        )
    report = Report(name, seed, asdict(schedule), sum(p.numel() for p in params))
    model.train()
    began = time.perf_counter()
    quiet = not is_writer()
    with tqdm(range(schedule.steps), desc=f"train {name}", unit="step", dynamic_ncols=True, disable=quiet) as bar:
        for step in bar:
            for group in optimiser.param_groups:
                group["lr"] = schedule.lr_at(step)
            loss = loss_of(start + step)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            loss = average_over_processes(params, loss.detach())
            torch.nn.utils.clip_grad_norm_(params, schedule.clip_norm)
            optimiser.step()
            if ema is not None:
                ema.update_parameters(model)
            report.losses.append(loss.item())
            if step % 10 == 0:
                bar.set_postfix(loss=f"{np.mean(report.losses[-50:]):.4f}")
    report.seconds = time.perf_counter() - began
    kept = ema.module if ema is not None else model
    return kept.eval(), report


def average_over_processes(params: list[torch.nn.Parameter], loss: torch.Tensor) -> torch.Tensor:
    """Replace each gradient (and the loss) by its mean over the run's processes, in one
    all-reduce; returns the mean loss. A no-op in a single-process run."""
    world = process_group()[1]
    if world == 1:
        return loss
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads] + [loss.reshape(1)])
    dist.all_reduce(flat)
    flat /= world
    start = 0
    for p, g in zip(params, grads):
        p.grad = flat[start : start + g.numel()].view_as(g)
        start += g.numel()
    return flat[-1]


def seed_everything(seed: int, device: torch.device | str = "cpu", start: int = 0) -> torch.Generator:
    """Seed torch's global RNG (weight init, dropout; the same in every process, so all start from
    the same weights) and return this process's generator on `device` for the run's noise (a GPU's
    generator draws other numbers than the CPU's: a run replays on the device kind it ran on); a
    run resumed at data step `start` draws noise of its own."""
    torch.manual_seed(seed)
    rank, world = process_group()
    noise = seed if world == 1 else seed * 1000 + rank
    return torch.Generator(device).manual_seed(noise if not start else noise * 1_000_003 + start)

