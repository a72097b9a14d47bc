"""`gouache bench edit`: what mask-aware template reuse saves, and what it costs (InstGenIE §6).

Three measurements, one run, one model:

- **Latency vs mask ratio** (in-process runner, one edit at a time): a template is registered
  (every token kept, activations recorded), then edits with a centred rectangle of each mask
  ratio run in full (the exact edit) and with the template: with a prompt of their own, from
  host memory and from a store whose only tier is the disk (every step read back from a file,
  prefetched one step ahead), and with the template's own prompt (then a DiT's text rows replay
  too; with a prompt of its own only CFG's unconditional row's do).
  Medians of step time and of the whole request (text encoding, VAE and decoding included).
  `bound` is the least share of the full step that an edit with a prompt of its own can reach:
  a DiT also runs its prompt's text rows, which InstGenIE's 4096-token images hide and small
  ones do not; UNets also run their resnets and convolutions in full (the transformer blocks' share of
  a step, `transformer_share`, is measured here). A UNet's token is a latent pixel.
- **Fidelity** (`--edits` masked edits): a shapes scene rendered as the template, one shape
  recoloured, its grid cell the mask, the new caption the prompt (the template registered with
  the scene's own caption); on an instruction-edit model (shapes-edit) an instruction edit of a
  few cells (recolour, move, remove, add in turn), the cells it changes the mask, the
  instruction the prompt of the edit and its template. Each edit runs exact and with the
  template; reported: SSIM of the masked region, whether the unmasked pixels equal the
  template's, and the checker's verdicts on both (all right; for instruction edits carried out
  and the rest kept).
- **Throughput** (`--requests` edits of `--templates` templates, Poisson arrivals at `--rate`):
  the in-process engine with `--policy` and templates (registered before the clock starts)
  against `fcfs-static` regenerating every edit in full; edits per second and mean latency.

Writes JSON, a markdown table, a plot (step time vs mask ratio) and a contact sheet of the first
fidelity edits (`..._sheet.png`: template, exact, both replays, their differences).
"""

from __future__ import annotations

import asyncio
import io
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from gouache.bench.edit_cases import Shown, instruction_cases, picture, rates, recolour_cases, write_sheet
from gouache.bench.fidelity import acceptable, drop_points, ssim
from gouache.bench.load import run_load
from gouache.bench.results import write_results
from gouache.data.shapes import caption, cell_box, sample_scene
from gouache.profile.edits import centred_mask
from gouache.uploads import EditMask, Upload

RATIOS = "0.05,0.1,0.2,0.4,0.6,0.8"
SHEET_ROWS = 8  # fidelity edits shown on the contact sheet


def add_arguments(p) -> None:
    p.add_argument("--model", default="shapes-dit", help="a pipeline, built-in or a directory (default: %(default)s)")
    p.add_argument("--size", type=int, default=None, help="square side in pixels (default: the model's)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    p.add_argument("--ratios", default=RATIOS, help="mask ratios of the latency sweep (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed edits per ratio and setup, median reported "
                                                           "(default: %(default)s)")
    p.add_argument("--edits", type=int, default=24,
                   help="masked edits for fidelity (recolour edits; instruction edits on an instruction-edit model); "
                        "0 skips (default: %(default)s)")
    p.add_argument("--requests", type=int, default=24, help="edits of the throughput load; 0 skips "
                                                             "(default: %(default)s)")
    p.add_argument("--templates", type=int, default=4, help="templates the load edits (default: %(default)s)")
    p.add_argument("--rate", type=float, default=None,
                   help="Poisson arrivals per second of the load (default: 3x what fcfs-static sustains, "
                        "from the sweep)")
    p.add_argument("--policy", default="orca", help="gouache's policy under the load (default: %(default)s)")
    p.add_argument("--torch-threads", type=int, default=None, help="intra-op threads of torch (default: torch's)")
    p.add_argument("--out", default=None,
                   help="JSON path; .md, .png and the contact sheet _sheet.png beside it "
                        "(default: benchmarks/results/edit/edit_MODEL_SIZE.json)")


def run(args) -> int:
    import torch

    from gouache.models.zoo import load_pipeline
    from gouache.runner.describe import model_info

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    pipe = load_pipeline(args.model)
    info = model_info(pipe, args.model)
    size = args.size or info.default_size
    steps = args.steps or info.default_steps
    ratios = [float(r) for r in args.ratios.split(",")]
    if not all(0 < r <= 1 for r in ratios):
        raise ValueError(f"--ratios must be in (0, 1], got {args.ratios!r}")
    bench = Bench(pipe, info, size, steps)
    sweep = [bench.latency(ratio, args.repeats) for ratio in ratios]
    result = {"command": "gouache bench edit " + " ".join(sys.argv[3:]), "model": args.model,
              "device": "cpu", "size": size, "steps": steps, "torch_threads": torch.get_num_threads(),
              "text_rows": bench.text_rows, "image_tokens": bench.tokens, "reference_tokens": bench.reference_tokens,
              "transformer_share": bench.transformer_share, "latency": sweep}
    shown = []
    if args.edits:
        result["fidelity"], shown = bench.fidelity(args.edits)
    if args.requests:
        full_s = next(row["full_request_s"] for row in sweep if row["ratio"] == max(ratios))
        rate = args.rate or 3 / full_s
        result["throughput"] = throughput(args.model, info, size, steps, args.requests, args.templates, rate,
                                          args.policy, args.torch_threads)
    out = Path(args.out or f"benchmarks/results/edit/edit_{args.model}_{size}.json")
    title = f"{args.model} {size}x{size}, {steps} steps, CPU"
    write_results(out, result, report(result), lambda path: plot(sweep, path, title))
    if shown:
        sheet = out.with_name(out.stem + "_sheet.png")
        write_sheet(shown, sheet)
        print(f"wrote {sheet}")
    return 0


class Bench:
    """Edits of one model at one size, one at a time, on in-process runners."""

    def __init__(self, pipe, info, size: int, steps: int):
        self.pipe, self.info, self.size, self.steps = pipe, info, size, steps
        self.runner = self._runner(disk_only=False)
        self.disk_runner = self._runner(disk_only=True)
        self.token = self.runner.family.token_pixels
        self.grid = size // self.token
        self.tokens = self.grid**2
        self._ids = 0  # request ids: each edit its own
        blank = np.zeros((size, size, 3), np.uint8)
        probe = self.runner.family.prepare(self._request("probe", "a red circle"),
                                           Upload(blank, EditMask.whole(size, size)))
        self.text_rows = probe.cond["prompt_embeds"].shape[1] if not self.runner.family.patches else 0
        # an edit's reference tokens (FLUX.1 Kontext) run beside its own, and replay from the template
        self.reference_tokens = self.runner.family.token_count(probe) - self.tokens
        self.transformer_share = self._transformer_share() if self.runner.family.patches else 1.0

    def _runner(self, disk_only: bool):
        from gouache.config import TemplateConfig
        from gouache.runner.model_runner import ModelRunner

        config = TemplateConfig(host_bytes=0) if disk_only else TemplateConfig()
        return ModelRunner(self.pipe, templates=config)

    def _request(self, prefix: str, prompt: str, seed: int = 0, **fields):
        from gouache.request import ImageRequest

        self._ids += 1
        return ImageRequest(f"{prefix}-{self._ids}", prompt, self.size, self.size, self.steps,
                            self.info.default_guidance, seed, image=b"-", **fields)

    def edit(self, runner, request, image: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, float, float]:
        """(image, median step seconds, request seconds) of one edit, start to end."""
        from gouache.sched.plan import Batch

        start = time.perf_counter()
        runner.prepare(request, Upload(image, EditMask(mask)))
        step_s = []
        for _ in range(self.steps):
            output = runner.execute(Batch((request.request_id,)))
            if output.failed:
                raise RuntimeError(f"edit failed: {output.failed}")
            step_s.append(output.forward_s)
        out = runner.decode(request.request_id)
        runner.release(request.request_id)
        return out, statistics.median(step_s), time.perf_counter() - start

    def _transformer_share(self) -> float:
        """The share of a UNet's full edit steps spent in its transformer blocks (the rest runs
        on every token whatever the mask)."""
        from gouache.templates.unet import unet_template_blocks

        spent, starts = [0.0], {}

        def before(module, args):
            starts[id(module)] = time.perf_counter()

        def after(module, args, out):
            spent[0] += time.perf_counter() - starts.pop(id(module))

        blocks = [getattr(parent, name) for parent, name, _ in unet_template_blocks(self.runner.family.unet)]
        hooks = [h for b in blocks for h in (b.register_forward_pre_hook(before), b.register_forward_hook(after))]
        image = picture(sample_scene(random.Random(2)), self.size, seed=2)
        try:
            _, step_s, _ = self.edit(self.runner, self._request("share", "a red circle"), image,
                                     np.ones((self.size, self.size), np.float32))
        finally:
            for hook in hooks:
                hook.remove()
        return min(1.0, spent[0] / self.steps / step_s)

    def register(self, runner, template_id: str, image: np.ndarray, prompt: str, seed: int = 0) -> None:
        request = self._request("register", prompt, seed, template_id=template_id, register_template=True)
        self.edit(runner, request, image, np.zeros(image.shape[:2], np.float32))

    def latency(self, ratio: float, repeats: int) -> dict:
        mask, token_ratio = centred_mask(self.size, self.token, ratio)
        image = picture(sample_scene(random.Random(1)), self.size, seed=1)
        template_id = f"sweep-{ratio}"
        own, new = "a red circle", "a blue square"  # the template's prompt, an edit's
        for runner in (self.runner, self.disk_runner):
            self.register(runner, template_id, image, own)
        timings = {}
        for label, runner, template, prompt in (("full", self.runner, False, new), ("replay", self.runner, True, new),
                                                ("disk", self.disk_runner, True, new),
                                                ("same_prompt", self.runner, True, own)):
            runs = [self.edit(runner, self._request(label, prompt, seed=k, template_cache=template,
                                                    template_id=template_id), image, mask)[1:]
                    for k in range(repeats + 1)][1:]  # the first is a warm-up
            timings[label] = [statistics.median(r[i] for r in runs) for i in (0, 1)]
        rows = self.info.cfg_rows(self.info.default_guidance)
        return {
            "ratio": ratio, "token_ratio": token_ratio,
            "full_step_ms": 1e3 * timings["full"][0], "replay_step_ms": 1e3 * timings["replay"][0],
            "step_ratio": timings["replay"][0] / timings["full"][0],
            "full_request_s": timings["full"][1], "replay_request_s": timings["replay"][1],
            "request_ratio": timings["replay"][1] / timings["full"][1],
            "disk_step_ms": 1e3 * timings["disk"][0], "disk_vs_memory": timings["disk"][0] / timings["replay"][0],
            "same_prompt_step_ms": 1e3 * timings["same_prompt"][0],
            "same_prompt_ratio": timings["same_prompt"][0] / timings["full"][0],
            "bound": self._bound(token_ratio, rows),
            "cfg_rows": rows,
        }

    def _bound(self, token_ratio: float, rows: int) -> float:
        """The least share of a full step that an edit with a prompt of its own can reach: its
        masked tokens and one row's text rows computed (with CFG the unconditional row's text
        replays, a reference's tokens replay); a UNet's resnets and convolutions stay."""
        text, tokens = self.text_rows, self.tokens
        computed = rows * token_ratio * tokens + text
        every = rows * (text + tokens + self.reference_tokens)
        return 1 - self.transformer_share + self.transformer_share * computed / every

    def fidelity(self, n: int) -> tuple[dict, list[Shown]]:
        """Masked edits, exact and replayed from a template registered with the edit's own seed
        (the noise of the kept region agrees) and with another one: recolour edits of a captioned
        scene (`recolour_cases`), or on an instruction-edit model instruction edits
        (`instruction_cases`). Also the first `SHEET_ROWS` edits' images, for the contact sheet."""
        cases = instruction_cases(n, self.size) if self.info.instruction_edit else recolour_cases(n, self.size)
        exact_checks, replays, shown = [], {"same_seed": [], "other_seed": []}, []
        for i, case in enumerate(cases):
            rows, cols = np.nonzero(case.mask)
            box = (slice(rows.min(), rows.max() + 1), slice(cols.min(), cols.max() + 1))
            exact = self.edit(self.runner, self._request("exact", case.prompt, seed=i), case.template, case.mask)[0]
            exact_checks.append(case.judge(exact))
            exact_ok = rates(exact_checks[-1:])["all"] == 1
            outputs = {}
            for variant, seed in (("same_seed", i), ("other_seed", 10_000 + i)):
                template_id = f"fidelity-{variant}-{i}"
                self.register(self.runner, template_id, case.template, case.template_prompt, seed)
                replay = self.edit(self.runner, self._request("replay", case.prompt, seed=i, template_cache=True,
                                                              template_id=template_id), case.template, case.mask)[0]
                outputs[variant] = replay
                replays[variant].append({
                    "prompt": case.prompt, "mask_ratio": float(case.mask.mean()),
                    "masked_ssim": ssim(exact[box], replay[box]),
                    "unmasked_equal": bool(np.array_equal(replay[case.mask == 0], case.template[case.mask == 0])),
                    "exact_ok": exact_ok, "check": case.judge(replay)})
            if i < SHEET_ROWS:
                shown.append(Shown(case, exact, **outputs))
        exact_rates = rates(exact_checks)
        out = {"edits": n, "kind": "instruction" if self.info.instruction_edit else "recolour",
               "exact_alignment": exact_rates["all"], "exact_rates": exact_rates}
        for variant, edits in replays.items():
            ssims = [e["masked_ssim"] for e in edits]
            checks = [e.pop("check") for e in edits]
            for edit, check in zip(edits, checks):
                edit["ok"] = rates([check])["all"] == 1  # all right, as exact_ok: both checks of an instruction edit
            variant_rates = rates(checks)
            drop = drop_points(exact_rates, variant_rates, variant_rates)
            out[variant] = {"masked_ssim_mean": float(np.mean(ssims)), "masked_ssim_min": float(np.min(ssims)),
                            "unmasked_equal": sum(e["unmasked_equal"] for e in edits),
                            "alignment": variant_rates["all"], "rates": variant_rates,
                            "alignment_drop_points": drop,
                            "acceptable": acceptable(float(np.mean(ssims)), drop),
                            "per_edit": edits}
        return out, shown


def throughput(model: str, info, size: int, steps: int, n: int, templates: int, rate: float, policy: str,
               torch_threads: int | None) -> dict:
    """The same Poisson edit load through gouache (`policy`, templates) and `fcfs-static` (full)."""
    rng = random.Random("edit-load")
    scenes = [sample_scene(rng) for _ in range(templates)]
    pictures = [_png(picture(scene, size, seed=t)) for t, scene in enumerate(scenes)]
    load = []
    for k in range(n):
        t = rng.randrange(templates)
        shape = rng.choice(scenes[t].shapes)
        left, top, right, bottom = (round(v) for v in cell_box(shape.position, size, size))
        mask = np.full((size, size, 4), 255, np.uint8)
        mask[top:bottom, left:right, 3] = 0  # transparent = repaint
        load.append((t, _png(mask), rng.expovariate(rate), k))
    runs = {}
    for label, engine_policy, use in ((policy + "+templates", policy, True), ("fcfs-static", "fcfs-static", False)):
        runs[label] = asyncio.run(_serve_load(model, info, size, steps, engine_policy, use, scenes, pictures, load,
                                              torch_threads))
    ours, base = runs[policy + "+templates"], runs["fcfs-static"]
    return {"requests": n, "templates": templates, "rate_per_s": rate, "runs": runs,
            "throughput_ratio": ours["edits_per_s"] / base["edits_per_s"],
            "latency_ratio": ours["mean_latency_s"] / base["mean_latency_s"]}


async def _serve_load(model, info, size, steps, policy, use_templates, scenes, pictures, load, torch_threads) -> dict:
    from gouache.config import EngineConfig, ModelConfig, SchedulerConfig
    from gouache.engine.build import build_engine
    from gouache.request import ImageRequest

    engine = build_engine(ModelConfig(model), EngineConfig(max_queue_len=len(load) + len(pictures),
                                                           torch_threads=torch_threads),
                          SchedulerConfig(policy=policy))
    await engine.start()

    def request(rid, prompt, image, seed=0, **fields):
        return ImageRequest(rid, prompt, size, size, steps, info.default_guidance, seed, image=image,
                            arrival_time=time.monotonic(), **fields)

    try:
        if use_templates:  # registered before the clock starts: a template's edits come by the thousand
            for t, (scene, picture) in enumerate(zip(scenes, pictures)):
                job = request(f"register-{t}-0", caption(scene), picture, template_cache=True,
                              template_id=f"load-{t}", register_template=True)
                await (await engine.submit([job])).images()

        def edit(t, mask, k):
            return lambda: [request(f"edit-{k}-0", caption(scenes[t]), pictures[t], mask=mask, seed=k,
                                    template_cache=use_templates, template_id=f"load-{t}" if use_templates else None)]

        measured = await run_load(engine, [(gap, edit(t, mask, k)) for t, mask, gap, k in load])
    finally:
        await engine.aclose()
    return {"policy": policy, "templates": use_templates, "seconds": measured["seconds"],
            "edits_per_s": measured["per_s"], "mean_latency_s": measured["mean_latency_s"],
            "p90_latency_s": measured["p90_latency_s"]}


def _png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def _references(result: dict) -> str:
    tokens = result.get("reference_tokens", 0)
    return f" (and {tokens} of the edit's reference)" if tokens else ""


def report(result: dict) -> str:
    lines = [f"{result['model']} at {result['size']}x{result['size']}, {result['steps']} steps: "
             f"{result['image_tokens']} image tokens{_references(result)}, {result['text_rows']} text rows per image, "
             "transformer "
             f"blocks {100 * result['transformer_share']:.0f} % of a full step",
             "", "| mask | tokens | full step ms | template step ms | ratio | bound | request ratio "
             "| disk step ms | disk / memory | same prompt ms | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["latency"]:
        lines.append(f"| {r['ratio']:g} | {r['token_ratio']:.2f} | {r['full_step_ms']:.1f} | {r['replay_step_ms']:.1f} "
                     f"| {r['step_ratio']:.2f} | {r['bound']:.2f} | {r['request_ratio']:.2f} "
                     f"| {r['disk_step_ms']:.1f} | {r['disk_vs_memory']:.2f} | {r['same_prompt_step_ms']:.1f} "
                     f"| {r['same_prompt_ratio']:.2f} |")
    fidelity = result.get("fidelity")
    if fidelity:
        exact_rates = fidelity["exact_rates"]
        names = {"all": "all right", "carried_out": "carried out", "rest_kept": "rest kept"}
        exact = ", ".join(f"{names[k]} {100 * v:.0f} %" for k, v in exact_rates.items())
        lines += ["", f"Fidelity, {fidelity['edits']} {fidelity['kind']} edits against the exact "
                      f"edit ({exact}):", "",
                  "| template registered with | masked SSIM mean (min) | unmasked = template | "
                  + " | ".join(names[k] for k in exact_rates) + " | acceptable |",
                  "|---|---|---|" + "---|" * len(exact_rates) + "---|"]
        for variant, label in (("same_seed", "the edit's seed"), ("other_seed", "another seed")):
            f = fidelity[variant]
            shown = f["rates"]
            lines.append(f"| {label} | {f['masked_ssim_mean']:.3f} ({f['masked_ssim_min']:.3f}) | "
                         f"{f['unmasked_equal']}/{fidelity['edits']} | "
                         + " | ".join(f"{100 * shown[k]:.0f} %" for k in exact_rates)
                         + f" | {'yes' if f['acceptable'] else 'no'} |")
    load = result.get("throughput")
    if load:
        lines += ["", f"Throughput, {load['requests']} edits of {load['templates']} templates, Poisson "
                      f"{load['rate_per_s']:.2f}/s:", "", "| setup | edits/s | mean latency s | p90 s |",
                  "|---|---|---|---|"]
        for label, r in load["runs"].items():
            lines.append(f"| {label} | {r['edits_per_s']:.2f} | {r['mean_latency_s']:.2f} | {r['p90_latency_s']:.2f} |")
        lines.append(f"\nthroughput ratio {load['throughput_ratio']:.2f}, "
                     f"mean latency ratio {load['latency_ratio']:.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["token_ratio"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r["full_step_ms"] for r in rows], "o-", label="full regeneration")
    ax.plot(x, [r["replay_step_ms"] for r in rows], "s-", label="template, host memory")
    ax.plot(x, [r["disk_step_ms"] for r in rows], "^--", label="template, disk tier only")
    ax.plot(x, [r["same_prompt_step_ms"] for r in rows], "d-", label="template, its own prompt")
    ax.plot(x, [r["bound"] * r["full_step_ms"] for r in rows], ":", color="gray", label="bound, own prompt")
    ax.set_xlabel("share of image tokens repainted")
    ax.set_ylabel("median step ms")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
