"""`gouache bench fidelity`: how far a candidate engine configuration's images are from the exact
ones, and whether they still show what the prompt asked for.

Prompts are shapes captions (`gouache.data.shapes`) at one or more sizes, each with one or more
seeds; for a model that only edits (shapes-edit), instruction edits of shapes scenes
(`gouache.data.edits`), checked by `check_edit` (carried out; the rest kept). The reference
(exact: default steps, `orca`) and the candidate (fewer steps, another policy, another batch
size, an approximation) each make every image in this process. Reported: SSIM and PSNR of
candidate against reference, the checker's prompt alignment for both (colour, shape, position,
all; for edits carried out, rest kept, both), and whether the candidate is acceptable (SSIM >=
0.95 and alignment within 2 points of the reference's: all right, or for edits each of carried
out and rest kept). Speed: the engine's summed step latencies while making the images
(`denoise_ratio`), and the mean step time of one steady batch denoised start to end by each
setup in turn, apart from the engine's stages (`steady_step_ratio`). Writes JSON, a markdown
table and a contact sheet (reference | candidate | difference; edits begin with the upload).
"""

from __future__ import annotations

import asyncio
import io
import json
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from PIL import Image

from gouache.bench.prompts import Control, controls, encoded_upload
from gouache.bench.sheet import contact_sheet, difference
from gouache.cli_flags import Given, given, parse_size, refuse_ignored
from gouache.data.checker import Check, EditCheck, check, check_edit
from gouache.data.prompts import Prompt, make_edit_prompts, make_prompts

SSIM_ACCEPTABLE = 0.95  # mean SSIM against the reference at or above which a candidate may ship
ALIGNMENT_POINTS = 2.0  # ... if its "all ok" alignment is at most this many points below the reference's
ALIGNMENT_KEYS = ("colour", "shape", "position", "all")


@dataclass(frozen=True)
class Setup:
    """One engine configuration every prompt runs through."""

    label: str
    policy: str = "orca"
    steps: int | None = None  # None: the model's default
    max_batch_size: int = 8
    patch_size: int | None = None  # the largest patch side under patched policies; None: the server's default
    cost_model: str | None = None  # for policies that plan with step times
    block_cache: float = 0.0  # the block cache's threshold for every image; 0: off
    block_cache_max_reuse: int = 2
    block_cache_predictor: str | None = None  # `gouache profile --reuse` file deciding reuse; None: the threshold
    controlnet_mode: str | None = None  # every prompt placed by a layout-map ControlNet in this mode; None: none
    quantize: str | None = None  # the denoiser's linear layers quantized (`gouache.runner.quantize`); None: as loaded

    def describe(self) -> str:
        steps = "default" if self.steps is None else str(self.steps)
        cache = f", block cache {self.block_cache:g}" if self.block_cache else ""
        cache += f" by the predictor {Path(self.block_cache_predictor).name}" if self.block_cache_predictor else ""
        control = f", ControlNet {self.controlnet_mode}" if self.controlnet_mode else ""
        quantized = f", {self.quantize} weights" if self.quantize else ""
        return f"{self.policy}, {steps} steps, batch <= {self.max_batch_size}{cache}{control}{quantized}"


@dataclass
class Result:
    """One setup's images and what they cost."""

    setup: Setup
    images: list[np.ndarray] = field(default_factory=list)  # [H, W, 3] uint8, in prompt order
    seconds: float = 0.0
    denoise_seconds: float = 0.0  # of which in denoising steps (the engine's step latencies, summed)
    reused_fraction: float = 0.0  # block cache: unit-blocks reused / all of them
    decide_share: float = 0.0  # block cache: the predictor's decisions' time / the denoising steps'


def generate(model: str, setup: Setup, prompts: list[Prompt], torch_threads: int | None = None,
             control: Control | None = None) -> Result:
    """Every prompt through an in-process engine at once, so the policy batches them as it would."""
    return asyncio.run(_generate(model, setup, prompts, torch_threads, control))


async def _generate(model: str, setup: Setup, prompts: list[Prompt], torch_threads: int | None,
                    control: Control | None = None) -> Result:
    from gouache.config import BlockCacheConfig, ControlNetConfig, EngineConfig, ModelConfig, SchedulerConfig
    from gouache.data.shapes import unplaced_caption
    from gouache.engine.build import build_engine
    from gouache.request import ImageRequest

    controlnets = ControlNetConfig(control.directory, control.workers) if control else ControlNetConfig()
    engine = build_engine(
        ModelConfig(model, quantize=setup.quantize),
        EngineConfig(max_queue_len=max(len(prompts), 1), patch_pixels=setup.patch_size, torch_threads=torch_threads,
                     block_cache=BlockCacheConfig(setup.block_cache, setup.block_cache_max_reuse,
                                                  predictor=setup.block_cache_predictor),
                     controlnet=controlnets),
        SchedulerConfig(policy=setup.policy, max_batch_size=setup.max_batch_size, cost_model=setup.cost_model),
    )
    info = engine.info
    await engine.start()
    start = time.perf_counter()
    try:
        handles = [
            await engine.submit([ImageRequest(
                f"fidelity-{i}-0", unplaced_caption(p.scene) if control else p.caption, p.width, p.height,
                setup.steps or info.default_steps, info.default_guidance, p.seed,
                image=encoded_upload(p),
                **controls(p, control, setup.controlnet_mode),
            )])
            for i, p in enumerate(prompts)
        ]
        events = await asyncio.gather(*(h.images() for h in handles))
    finally:
        await engine.aclose()
    images = [np.asarray(Image.open(io.BytesIO(e[0].image)).convert("RGB")) for e in events]
    samples = [s for m in engine.metrics.registry.collect() for s in m.samples]
    step_s = sum(s.value for s in samples if s.name == "gouache_step_latency_seconds_sum")
    blocks = {s.labels["result"]: s.value for s in samples if s.name == "gouache_block_cache_blocks_total"}
    total = sum(blocks.values())
    decide_s = sum(s.value for s in samples if s.name == "gouache_block_cache_decide_seconds_total")
    return Result(setup, images, time.perf_counter() - start, denoise_seconds=step_s,
                  reused_fraction=blocks.get("reused", 0.0) / total if total else 0.0,
                  decide_share=decide_s / step_s if step_s else 0.0)


def step_times(model: str, setups: tuple[Setup, ...], prompts: list[Prompt], repeats: int,
               torch_threads: int | None) -> list[list[float]]:
    """Per setup, the mean step time of `repeats` whole denoising runs of one steady batch (the first
    prompts, up to its batch size), the setups taking turns: the step time a running batch sees,
    without the engine's stages (text encoding, VAE decoding) competing for the CPU."""
    import torch

    from gouache.config import BlockCacheConfig
    from gouache.models.zoo import load_pipeline
    from gouache.runner.describe import model_info
    from gouache.runner.model_runner import ModelRunner
    from gouache.runner.quantize import quantize
    from gouache.sched.plan import Batch
    from gouache.sched.policies import POLICIES

    if torch_threads:
        torch.set_num_threads(torch_threads)
    pipes = {kind: quantize(load_pipeline(model), kind) for kind in {s.quantize for s in setups}}
    info = model_info(pipes[setups[0].quantize], model)
    times: list[list[float]] = [[] for _ in setups]
    for _ in range(repeats):
        for setup, out in zip(setups, times):
            runner = ModelRunner(pipes[setup.quantize], setup.patch_size, BlockCacheConfig(
                setup.block_cache, setup.block_cache_max_reuse, predictor=setup.block_cache_predictor))
            batch = prompts[: setup.max_batch_size]
            ids = tuple(runner.prepare(*p.prepared(f"steady-{i}", setup.steps or info.default_steps,
                                                   info.default_guidance)).request_id for i, p in enumerate(batch))
            patched, steps, start = POLICIES[setup.policy].mixes_resolutions, 0, time.perf_counter()
            while not runner.states[ids[0]].done:
                runner.execute(Batch(ids, (0,), 1, patched))
                steps += 1
            out.append((time.perf_counter() - start) / steps)
    return times


# ---------------------------------------------------------------------------------- metrics


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean structural similarity of two [H, W, 3] uint8 images (Wang et al. 2004: Gaussian window
    sigma 1.5, K1 0.01, K2 0.03), averaged over the colour channels."""
    from scipy.ndimage import gaussian_filter

    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    x, y = a.astype(np.float64), b.astype(np.float64)

    def blur(v: np.ndarray) -> np.ndarray:
        return gaussian_filter(v, sigma=(1.5, 1.5, 0), truncate=3.5)

    mx, my = blur(x), blur(y)
    vx, vy, cov = blur(x * x) - mx * mx, blur(y * y) - my * my, blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return float(s.mean())


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB (inf for equal images)."""
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def checks(images: list[np.ndarray], prompts: list[Prompt]) -> list[Check | EditCheck]:
    """The checker's verdict on each image against its prompt's scene, or its edit."""
    return [check_edit(image, prompt.edit) if prompt.edit else check(image, prompt.scene)
            for image, prompt in zip(images, prompts)]


def alignment(verdicts: list[Check]) -> dict[str, float]:
    """What the checker found, as fractions: per image (every asked shape right in colour, kind,
    position, all three), per asked shape (`object_*`), and per image by its number of shapes
    (`all_1shape`, ...; absent when no image has that many)."""
    images_ok, objects_ok = dict.fromkeys(ALIGNMENT_KEYS, 0), dict.fromkeys(ALIGNMENT_KEYS, 0)
    by_count: dict[int, list[bool]] = {}
    for result in verdicts:
        for key, ok in zip(ALIGNMENT_KEYS, (result.colour_ok, result.shape_ok, result.position_ok, result.all_ok)):
            images_ok[key] += ok
        for shape in result.shapes:
            found = (shape.colour_ok, shape.shape_ok, shape.position_ok)
            for key, ok in zip(ALIGNMENT_KEYS, (*found, all(found))):
                objects_ok[key] += ok
        by_count.setdefault(len(result.shapes), []).append(result.all_ok)
    n, objects = max(len(verdicts), 1), max(sum(len(r.shapes) for r in verdicts), 1)
    return {
        **{key: value / n for key, value in images_ok.items()},
        **{f"object_{key}": value / objects for key, value in objects_ok.items()},
        **{f"all_{count}shape": sum(oks) / len(oks) for count, oks in sorted(by_count.items())},
    }


def edit_rates(verdicts: list[EditCheck]) -> dict[str, float]:
    """What the checker found of edits, as fractions: instructions carried out, the rest kept, both
    (`all`)."""
    n = max(len(verdicts), 1)
    return {"carried_out": sum(v.carried_out for v in verdicts) / n,
            "rest_kept": sum(v.rest_kept for v in verdicts) / n, "all": sum(v.all_ok for v in verdicts) / n}


def edit_alignment(verdicts: list[EditCheck], prompts: list[Prompt]) -> dict[str, float]:
    """`edit_rates`, and both per edit kind (`all_recolour`, ...; absent when no prompt is of that kind)."""
    by_kind: dict[str, list[bool]] = {}
    for verdict, prompt in zip(verdicts, prompts):
        by_kind.setdefault(prompt.edit.kind, []).append(verdict.all_ok)
    return {**edit_rates(verdicts), **{f"all_{kind}": sum(oks) / len(oks) for kind, oks in by_kind.items()}}


def drop_points(reference: dict[str, float], candidate: dict[str, float], keys) -> float:
    """The largest fall, in percentage points, of the rates `keys` from reference to candidate
    (rounded: 0.73 - 0.71 is 2 points, not 2.0000000000000018)."""
    return round(max(100 * (reference[key] - candidate[key]) for key in keys), 6)


def acceptable(ssim_mean: float, drop: float) -> bool:
    """Whether a candidate may ship: SSIM_ACCEPTABLE and at most ALIGNMENT_POINTS of alignment lost."""
    return bool(ssim_mean >= SSIM_ACCEPTABLE and drop <= ALIGNMENT_POINTS)


def compare(reference: Result, candidate: Result, prompts: list[Prompt]) -> dict:
    """The report's numbers for one candidate against the reference."""
    ssims = [ssim(r, c) for r, c in zip(reference.images, candidate.images)]
    psnrs = [psnr(r, c) for r, c in zip(reference.images, candidate.images)]
    ref_checks, cand_checks = checks(reference.images, prompts), checks(candidate.images, prompts)
    edits = bool(prompts) and prompts[0].edit is not None
    if edits:
        ref_align, cand_align = edit_alignment(ref_checks, prompts), edit_alignment(cand_checks, prompts)
    else:
        ref_align, cand_align = alignment(ref_checks), alignment(cand_checks)
    finite = [p for p in psnrs if np.isfinite(p)]
    summary = {
        "ssim_mean": float(np.mean(ssims)), "ssim_min": float(np.min(ssims)),
        "psnr_mean_db": float(np.mean(finite)) if finite else None,  # over the images that differ
        "identical_images": sum(not np.isfinite(p) for p in psnrs),
        "reference_alignment": ref_align, "candidate_alignment": cand_align,
        # the largest drop of the rates that must hold: all right; for edits carried out and rest kept
        "alignment_drop_points": drop_points(ref_align, cand_align,
                                             ("carried_out", "rest_kept") if edits else ("all",)),
    }
    summary["acceptable"] = acceptable(summary["ssim_mean"], summary["alignment_drop_points"])
    summary["per_image"] = [
        {"caption": p.caption, **({"edit": p.edit.kind} if p.edit else {}), "size": f"{p.width}x{p.height}",
         "seed": p.seed, "ssim": s,
         "psnr_db": q if np.isfinite(q) else None,  # None: identical images
         "reference_ok": r.all_ok, "candidate_ok": c.all_ok}
        for p, s, q, r, c in zip(prompts, ssims, psnrs, ref_checks, cand_checks)
    ]
    return summary


# --------------------------------------------------------------------------- contact sheet


def write_contact_sheet(reference: Result, candidate: Result, prompts: list[Prompt], rows: int, path: Path) -> None:
    """One row per prompt: reference | candidate | |difference| x4, under a header naming both; edits
    start with the upload, and the row's instruction under it."""
    edits = prompts[0].edit is not None
    titles = (["upload, its instruction"] if edits else []) + [
        f"reference: {reference.setup.describe()}", f"candidate: {candidate.setup.describe()}", "|difference| x4"]
    shown = []
    for prompt, ref, cand in list(zip(prompts, reference.images, candidate.images))[:rows]:
        images = [ref, cand, difference(ref, cand)]
        shown.append(([prompt.upload(), *images], prompt.caption) if edits else (images, ""))
    contact_sheet(titles, shown, path)


# ------------------------------------------------------------------------------ command


def add_arguments(p) -> None:
    p.add_argument("--model", default="shapes-unet",
                   help="a shapes-trained built-in (shapes-unet, shapes-dit; shapes-edit, whose prompts are "
                        "instruction edits) or a directory of one (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=50,
                   help="distinct shapes captions, or instruction edits for a model that only edits "
                        "(default: %(default)s)")
    p.add_argument("--seeds", type=int, default=1, help="seeds per caption (default: %(default)s)")
    p.add_argument("--sizes", default="128x128",
                   help="comma-separated WxH sizes, taken in turn by the captions (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="reference steps (default: the model's)")
    p.add_argument("--policy", default="orca", help="reference policy (default: %(default)s)")
    p.add_argument("--candidate-steps", type=int, default=None, action=Given,
                   help="candidate steps (default: half the reference's when no other candidate option is given, "
                        "else the reference's)")
    p.add_argument("--candidate-policy", default=None, action=Given,
                   help="candidate policy (default: the reference's)")
    p.add_argument("--candidate-max-batch-size", type=int, default=None, action=Given,
                   help="candidate's most requests per step, another batch mix (default: the reference's, 8)")
    p.add_argument("--candidate-block-cache", type=float, default=None, action=Given,
                   help="candidate's block-cache threshold for every image (docs/block_cache.md) (default: off)")
    p.add_argument("--block-cache-max-reuse", type=int, default=2, action=Given,
                   help="with --candidate-block-cache: most steps in a row a block's output is reused "
                        "(default: %(default)s)")
    p.add_argument("--candidate-block-cache-predictor", default=None, action=Given, metavar="FILE",
                   help="with --candidate-block-cache: the `gouache profile --reuse` forest decides reuse, the value "
                        "its cut-off (reuse where P(reusable) > 1 - value) (default: the threshold)")
    p.add_argument("--patch-size", type=int, default=None, action=Given,
                   help="the largest patch side in pixels under patched policies, UNet models (default: the server's)")
    p.add_argument("--cost-model", default=None,
                   help="JSON from `gouache profile`, for policies that plan with step times (default: none)")
    p.add_argument("--controlnet", default=None,
                   help="place every prompt's shapes by this layout-map ControlNet (`gouache train controlnet` writes "
                        "'layout'); captions then say no positions (default: none)")
    p.add_argument("--controlnet-dir", default=None, action=Given,
                   help="its directory (default: the shapes UNet's trained ones)")
    p.add_argument("--candidate-quantize", default=None, choices=("int8", "fp8"), action=Given,
                   help="the candidate's denoiser with quantized linear layers (fp8: GPU only) (default: as loaded)")
    p.add_argument("--candidate-controlnet-mode", default=None, choices=("sync", "async", "none"), action=Given,
                   help="the candidate's ControlNet mode; none: the same captions without it (the reference's: "
                        "sync; default: the reference's)")
    p.add_argument("--controlnet-workers", type=int, default=1, action=Given,
                   help="ControlNet service processes under --controlnet (default: %(default)s)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--step-repeats", type=int, default=3,
                   help="denoising runs of one steady batch per setup, taking turns, for the step-time ratio "
                        "(the median of each setup's) (default: %(default)s)")
    p.add_argument("--sheet-rows", type=int, default=8,
                   help="prompts shown on the contact sheet (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/results/fidelity.json",
                   help="JSON path; the table (.md) and contact sheet (.png) go beside it (default: %(default)s)")


def setups(args) -> tuple[Setup, Setup]:
    """The reference and the candidate the flags describe."""
    from gouache.models.zoo import BUILTIN_MODELS, TINY_DEFAULT_STEPS

    reference = Setup("reference", args.policy, args.steps, 8, args.patch_size, args.cost_model,
                      controlnet_mode="sync" if args.controlnet else None)
    chosen = given(args) & {"candidate_steps", "candidate_policy", "candidate_max_batch_size", "candidate_block_cache",
                            "candidate_controlnet_mode", "candidate_quantize"}
    if not chosen:
        default_steps = args.steps or (TINY_DEFAULT_STEPS if args.model in BUILTIN_MODELS else None)
        if default_steps is None:
            raise ValueError("give --steps (or a --candidate-* option): a directory model's default steps are "
                             "unknown here")
        return reference, replace(reference, label="candidate", steps=max(default_steps // 2, 1))
    candidate = replace(
        reference, label="candidate",
        steps=args.candidate_steps if "candidate_steps" in chosen else reference.steps,
        policy=args.candidate_policy or reference.policy,
        max_batch_size=args.candidate_max_batch_size or reference.max_batch_size,
        block_cache=args.candidate_block_cache or 0.0, block_cache_max_reuse=args.block_cache_max_reuse,
        block_cache_predictor=args.candidate_block_cache_predictor,
        controlnet_mode=args.candidate_controlnet_mode or reference.controlnet_mode,
        quantize=args.candidate_quantize,
    )
    return reference, candidate


def _check_flags(args, *policies: str) -> None:
    """Counts of at least one; known policies; --cost-model exactly when a policy plans with step
    times; --patch-size only when one cuts images into patches."""
    from gouache.config import BlockCacheConfig
    from gouache.sched.policies import POLICIES

    for flag in ("prompts", "seeds", "steps", "candidate_steps", "candidate_max_batch_size", "patch_size", "sheet_rows",
                 "block_cache_max_reuse", "step_repeats"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
        if POLICIES[policy].needs_predictor and args.cost_model is None:
            raise ValueError(f"policy {policy} plans with predicted step times: give --cost-model")
    ignored = {}
    if args.cost_model is not None and not any(POLICIES[p].needs_predictor for p in policies):
        ignored["cost_model"] = "neither policy plans with step times"
    if "patch_size" in given(args) and not any(POLICIES[p].mixes_resolutions for p in policies):
        ignored["patch_size"] = "neither policy cuts images into patches"
    for flag in ("candidate_controlnet_mode", "controlnet_dir", "controlnet_workers"):
        if flag in given(args) and not args.controlnet:
            ignored[flag] = "without --controlnet no prompt has a ControlNet"
    for flag in ("block_cache_max_reuse", "candidate_block_cache_predictor"):
        if flag in given(args) and not args.candidate_block_cache:
            ignored[flag] = "no --candidate-block-cache above 0 reuses anything"
    refuse_ignored(ignored)
    if args.candidate_block_cache is not None:
        BlockCacheConfig(args.candidate_block_cache)  # in range, or the config's message


def only_edits(model: str) -> bool:
    """Whether `model` makes no images from text alone (shapes-edit): its prompts are then edits."""
    from gouache.models.zoo import load_pipeline, model_id
    from gouache.runner.describe import model_info

    return not model_info(load_pipeline(model), model_id(model)).generation


def run(args) -> int:
    from gouache.sim.report import markdown_table

    reference_setup, candidate_setup = setups(args)
    _check_flags(args, reference_setup.policy, candidate_setup.policy)
    edits = only_edits(args.model)
    if edits and args.controlnet:
        raise ValueError(f"--controlnet places the shapes of generations; {args.model} only edits")
    prompts = (make_edit_prompts if edits else make_prompts)(
        args.prompts, args.seeds, [parse_size(part) for part in args.sizes.split(",")])
    control = None
    if args.controlnet:
        from gouache.train.controlnet import controlnet_dir

        control = Control(args.controlnet, args.controlnet_dir or str(controlnet_dir(args.model)),
                          args.controlnet_workers)
    reference = generate(args.model, reference_setup, prompts, args.torch_threads, control)
    candidate = generate(args.model, candidate_setup, prompts, args.torch_threads, control)
    summary = compare(reference, candidate, prompts)
    # ControlNet runs: the engine's denoising time only (the steady batch runs no ControlNet service)
    steady = [[], []] if control else step_times(args.model, (reference_setup, candidate_setup), prompts,
                                                 args.step_repeats, args.torch_threads)
    step_s = [statistics.median(t) if t else None for t in steady]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    options = sys.argv[sys.argv.index("fidelity") + 1:] if "fidelity" in sys.argv else []  # none when called directly
    report = {
        "command": shlex.join(["gouache", "bench", "fidelity", *options]),
        "model": args.model, "prompts": args.prompts, "seeds": args.seeds, "sizes": args.sizes, "images": len(prompts),
        "edits": edits,
        **{r.setup.label: {**asdict(r.setup), "seconds": r.seconds, "denoise_seconds": r.denoise_seconds,
                           "reused_fraction": r.reused_fraction, "decide_share": r.decide_share, "steady_step_s": t,
                           "steady_step_samples_s": samples}
           for r, t, samples in zip((reference, candidate), step_s, steady)},
        "denoise_ratio": candidate.denoise_seconds / reference.denoise_seconds if reference.denoise_seconds else None,
        "steady_step_ratio": step_s[1] / step_s[0] if control is None else None,
        "controlnet": asdict(control) if control else None,
        **summary,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    rows = [
        {"setup": r.setup.label, "config": r.setup.describe(), "seconds": r.seconds,
         "denoise s": r.denoise_seconds, "blocks reused %": 100 * r.reused_fraction,
         **{f"{k} ok %": 100 * v for k, v in summary[f"{r.setup.label}_alignment"].items()}}
        for r in (reference, candidate)
    ]
    table = markdown_table(rows, digits=1) + "\n" + markdown_table([{
        "denoise time ratio": report["denoise_ratio"], "steady step ratio": report["steady_step_ratio"],
        "SSIM mean": summary["ssim_mean"], "SSIM min": summary["ssim_min"], "PSNR mean dB": summary["psnr_mean_db"],
        "alignment drop (points)": summary["alignment_drop_points"], "acceptable": summary["acceptable"],
    }])
    out.with_suffix(".md").write_text(f"`{report['command']}`\n\n{table}")
    write_contact_sheet(reference, candidate, prompts, args.sheet_rows, out.with_suffix(".png"))
    print(table)
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}", file=sys.stderr)
    return 0
