"""`gouache train vae|unet|inpaint|dit|edit|lora|edit-lora|controlnet`: reproduce one shapes model
from a seed, with a progress bar, a loss curve (PNG + JSON) and the weights as safetensors. Train
the VAE first: the others encode their images with the VAE found in `--out`. `edit` is the
instruction-edit model (FLUX.1 Kontext's pipeline) trained on edit pairs. `lora` is an adapter of
the trained UNet (a style: its palette turned by one), written to
`<out>/loras/shapes-unet/palette.safetensors`; `edit-lora` the same style as an adapter of the
edit model, written to `<out>/loras/shapes-edit/palette.safetensors`; `controlnet` a ControlNet of
the UNet (shapes placed by a layout map), written to `<out>/controlnets/shapes-unet/layout/`."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import socket
import sys
from pathlib import Path

# kind -> steps that fit in 30 minutes on a 2-core CPU (see benchmarks/results/train_*.json)
DEFAULT_STEPS = {"vae": 3000, "unet": 5200, "inpaint": 1500, "dit": 3300, "edit": 3000, "lora": 3000,
                 "edit-lora": 3000, "controlnet": 4000}
# kind -> the weights a resumed run continues (--resume)
RESUMES = {"unet": "shapes-unet", "dit": "shapes-dit", "edit": "shapes-edit"}
# kind -> the weights it starts from, which an earlier `gouache train` wrote into --out
NEEDS = {"vae": (), "unet": ("shapes-vae",), "inpaint": ("shapes-vae", "shapes-unet"), "dit": ("shapes-vae",),
         "edit": ("shapes-vae",), "lora": ("shapes-vae", "shapes-unet"), "edit-lora": ("shapes-vae", "shapes-edit"),
         "controlnet": ("shapes-vae", "shapes-unet")}


def default_out() -> Path:
    from gouache.models.trained import WEIGHTS_DIR

    return WEIGHTS_DIR


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=list(DEFAULT_STEPS),
                   help="which model: vae first, then unet, dit or edit; inpaint fine-tunes the trained unet, lora and "
                        "controlnet train adapters of it, edit-lora an adapter of edit")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the weights, the data and the noise (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimiser steps (default: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items()) + ")")
    p.add_argument("--out", type=Path, default=None,
                   help="directory of the weights read (the VAE) and written (default: the built-in models' own)")
    p.add_argument("--report", type=Path, default=Path("benchmarks/results"),
                   help="directory for train_<kind>.json and .png (default: %(default)s)")
    p.add_argument("--workers", type=int, default=None,
                   help=f"data-parallel CPU processes of one thread-share each (default: one per core, "
                        f"{os.cpu_count() or 1}, on the CPU; 1 on a GPU); the same seed gives the same weights "
                        "only with the same number")
    p.add_argument("--resume", action="store_true",
                   help="continue the weights of this kind in --out for --steps more, on the batches a longer run "
                        "would draw next (" + ", ".join(RESUMES) + "); train_KIND.json in --report, the run "
                        "resumed, says where, and the new one lists every run before it (default: from the start)")
    p.add_argument("--lr", type=float, default=None,
                   help="the learning rate the warm-up reaches and the cosine decay starts from (default: the kind's "
                        "own, in train_KIND.json's schedule); a resumed run may want less than a fresh one")
    p.add_argument("--timestep-shift", type=float, default=None,
                   help="dit: the training noise levels' shift, logit-normal draws u as shift u / (1 + (shift - 1) u) "
                        "(default: 3, the sampler's); 1 trains the low and middle noise levels more")
    p.add_argument("--device", default="cpu",
                   help="torch device to train on, e.g. cuda (default: %(default)s); a GPU draws other random numbers "
                        "than the CPU, so its weights differ from the CPU's for the same seed")


def run(args: argparse.Namespace) -> int:
    from gouache.models.trained import weights_path

    steps = args.steps if args.steps is not None else DEFAULT_STEPS[args.kind]
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    if args.lr is not None and not 0 < args.lr < math.inf:
        raise ValueError(f"--lr must be a positive number, got {args.lr}")
    if args.timestep_shift is not None and args.kind != "dit":
        raise ValueError(f"--timestep-shift is the dit's; {args.kind} trains at its own noise levels")
    if args.timestep_shift is not None and not 0 < args.timestep_shift < math.inf:
        raise ValueError(f"--timestep-shift must be a positive number, got {args.timestep_shift}")
    import torch.multiprocessing

    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a torch device; give cpu or cuda (cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}: gouache trains on cpu or cuda")
    cpu = device.type == "cpu"
    if args.workers is None:
        args.workers = (os.cpu_count() or 1) if cpu else 1
    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    if args.workers > 1 and not cpu:
        raise ValueError(f"--workers {args.workers} runs CPU processes; "
                         f"on --device {args.device} train with --workers 1")
    if not cpu and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: torch sees no CUDA device on this machine")
    out = args.out if args.out is not None else default_out()
    for name in NEEDS[args.kind]:
        if not weights_path(name, out).is_file():
            raise FileNotFoundError(f"{weights_path(name, out)} is missing; `gouache train` writes it")
    args.start, args.runs_before = resumed(args, out) if args.resume else (0, [])
    if args.workers == 1:
        train_and_report(args, steps, out)
        return 0
    with socket.socket() as s:  # a free port for the processes to meet on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(args, steps, out, port), nprocs=args.workers)
    return 0


def resumed(args: argparse.Namespace, out: Path) -> tuple[int, list[dict]]:
    """(the data step a resumed run starts at, the runs before it) from the report of the run it
    continues."""
    from gouache.models.trained import weights_path

    if args.kind not in RESUMES:
        raise ValueError(f"--resume continues {', '.join(RESUMES)}; {args.kind} trains from the start")
    earlier = args.report / f"train_{args.kind}.json"
    for path in (weights_path(RESUMES[args.kind], out), earlier):
        if not path.is_file():
            raise FileNotFoundError(f"--resume continues a run of `gouache train {args.kind}`, but {path} is missing")
    previous = json.loads(earlier.read_text())
    runs = [*previous["extra"].get("runs_before", []),
            {key: previous[key] for key in ("command", "steps", "minutes")}]
    return sum(run["steps"] for run in runs), runs


def _worker(rank: int, args: argparse.Namespace, steps: int, out: Path, port: int) -> None:
    import torch
    import torch.distributed as dist

    # One process per core beats one process over all cores: 1.6x the images per second here.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.workers))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.workers)
    try:
        train_and_report(args, steps, out)
    finally:
        dist.destroy_process_group()


def train_and_report(args: argparse.Namespace, steps: int, out: Path) -> None:
    """Train args.kind in this process (one of a data-parallel run's, or the only one); the first
    process writes the loss curve and says where everything went."""
    from gouache.train.controlnet import train_controlnet
    from gouache.train.dit import train_dit
    from gouache.train.edit import train_edit
    from gouache.train.inpaint import train_inpaint
    from gouache.train.loop import is_writer
    from gouache.train.lora import train_edit_lora, train_lora
    from gouache.train.unet import train_unet
    from gouache.train.vae import train_vae

    trainer = {"vae": train_vae, "unet": train_unet, "inpaint": train_inpaint, "dit": train_dit, "edit": train_edit,
               "lora": train_lora, "edit-lora": train_edit_lora, "controlnet": train_controlnet}[args.kind]
    given = {"start": args.start, "lr": args.lr, "shift": args.timestep_shift}
    report = trainer(args.seed, steps, out, args.device, **{k: v for k, v in given.items() if v})
    if not is_writer():
        return
    report.extra.update(workers=args.workers, device=args.device)
    if args.resume:
        report.extra.update(runs_before=args.runs_before, steps_before=args.start, total_steps=args.start + steps,
                            total_minutes=round(sum(r["minutes"] for r in args.runs_before) + report.seconds / 60, 2))
    command = ["gouache", "train", args.kind, "--seed", str(args.seed), "--steps", str(steps),
               "--workers", str(args.workers)] + (["--resume"] if args.resume else [])
    if args.lr is not None:
        command += ["--lr", repr(args.lr)]
    if args.timestep_shift is not None:
        command += ["--timestep-shift", repr(args.timestep_shift)]
    if args.device != "cpu":
        command += ["--device", args.device]
    json_path, png_path = report.write(args.report, shlex.join(command))
    print(f"trained {args.kind} in {report.seconds / 60:.1f} min: loss {report.smoothed()[-1]:.4f}; "
          f"weights in {out}, curve in {png_path}", file=sys.stderr)
