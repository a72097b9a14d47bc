"""`gouache profile --edits`: fit the mask-aware cost model (`MaskCostModel`) on this device.

Times, for each size and mask ratio and batch of 1 and 2 edits of one template, the denoising
step of edits that replay the template (masked tokens only: what `compute` predicts), the same
edits regenerated in full on the model's own path (`plain`), and moving one step's cached
activations of that mask ratio to the device (`load`: a host-to-device copy on a GPU, a memory
copy on a CPU). `gouache serve --template-cost-model PATH` plans each edit's steps with it
(InstGenIE's load plan); the simulator and the mask-aware router take the same kind of model.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from gouache.uploads import EditMask, Upload

RATIOS = "0.1,0.2,0.4,0.6,0.8,1.0"


def run(args) -> int:
    import torch

    from gouache.config import TemplateConfig
    from gouache.models.zoo import load_pipeline
    from gouache.runner.describe import model_info
    from gouache.runner.model_runner import ModelRunner
    from gouache.sched.costmodel import MaskCostModel, save
    from gouache.templates.unet import unet_template_blocks

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    pipe = load_pipeline(args.model, args.dtype, args.device)
    info = model_info(pipe, args.model)
    runner = ModelRunner(pipe, templates=TemplateConfig(full_above=1.0))  # every replay masked, even at m = 1
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    sizes = [int(s) for s in args.sizes.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    by_size = {size: Edits(runner, info, size, args.repeats) for size in sizes}
    if runner.family.patches:  # a UNet: its transformer blocks, of a few widths; no text rows
        blocks = [getattr(parent, name) for parent, name, _ in unet_template_blocks(pipe.unet)]
        hidden, text = round(sum(b.attn1.to_q.in_features for b in blocks) / len(blocks)), 0
    else:
        config = pipe.transformer.config
        hidden, text = config.num_attention_heads * config.attention_head_dim, by_size[sizes[0]].text_rows
    model = MaskCostModel(hidden, len(runner.family.template_blocks()), torch.finfo(pipe.dtype).bits // 8,
                          text_tokens=text, tensors=3)
    compute, plain, load = [], [], []
    for edits in by_size.values():
        for ratio in ratios:
            for batch in (1, 2):
                rows = [(edits.tokens, centred_mask(edits.size, edits.token, ratio)[1])] * (batch * edits.rows)
                compute.append((rows, edits.step_s(ratio, batch, template=True)))
                plain.append((rows, edits.step_s(ratio, batch, template=False)))
                load.append((rows, _copy_s(model.cache_bytes(rows), args.device, args.repeats, sync)))
    report = model.fit(compute, load, plain)
    out = Path(args.out or f"benchmarks/results/costmodel_mask_{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    save(model, out)
    samples = [{"batch": rows, "replay_s": c, "plain_s": p, "load_s": ld}
               for (rows, c), (_, p), (_, ld) in zip(compute, plain, load)]
    summary = {"command": "gouache profile " + " ".join(sys.argv[2:]), "model": args.model, "device": args.device,
               "torch_threads": torch.get_num_threads(), "compute_r2": report.compute_r2, "load_r2": report.load_r2,
               "samples": samples}
    out.with_suffix(".report.json").write_text(json.dumps(summary, indent=2))
    print(f"compute R² {report.compute_r2:.3f}, load R² {report.load_r2:.3f} over {len(samples)} samples; wrote {out}")
    return 0


class Edits:
    """Edits of one template at one size, timed on the engine's own step path."""

    def __init__(self, runner, info, size: int, repeats: int):
        import random

        from gouache.data.shapes import render, sample_scene

        self.runner, self.info, self.size, self.repeats = runner, info, size, repeats
        self.token = runner.family.token_pixels
        self.tokens = (size // self.token) ** 2
        self.image = render(sample_scene(random.Random(size)), size, size, seed=size)
        self.rows = info.cfg_rows(info.default_guidance)
        self._ids = 0
        probe = runner.family.prepare(self._request("probe"))
        self.text_rows = probe.cond["prompt_embeds"].shape[1]
        # recorded with another prompt than its edits': they compute their own text rows, as most do
        self._run([self._request("register", "a green square", template_id=f"profile-{size}", register_template=True)],
                  np.zeros((size, size), np.float32))

    def _request(self, prefix: str, prompt: str = "a red circle", **fields):
        from gouache.request import ImageRequest

        self._ids += 1
        return ImageRequest(f"{prefix}-{self.size}-{self._ids}", prompt, self.size, self.size,
                            self.repeats + 1, self.info.default_guidance, self._ids, image=b"-", **fields)

    def step_s(self, ratio: float, batch: int, template: bool) -> float:
        """Median step seconds of `batch` edits repainting a centred square of `ratio`."""
        mask, _ = centred_mask(self.size, self.token, ratio)
        requests = [self._request("edit", template_cache=template, template_id=f"profile-{self.size}")
                    for _ in range(batch)]
        return statistics.median(self._run(requests, mask)[1:])  # the first step warms up

    def _run(self, requests, mask) -> list[float]:
        from gouache.sched.plan import Batch

        for request in requests:
            self.runner.prepare(request, Upload(self.image, EditMask(mask)))
        ids = tuple(r.request_id for r in requests)
        seconds = []
        for _ in range(requests[0].num_inference_steps):
            output = self.runner.execute(Batch(ids))
            if output.failed:
                raise RuntimeError(f"profiled edit failed: {output.failed}")
            seconds.append(output.forward_s)
        for rid in ids:
            self.runner.release(rid)
        return seconds


def _copy_s(nbytes: float, device: str, repeats: int, sync) -> float:
    """Median seconds to move `nbytes` of host memory to `device` (a copy, on a CPU)."""
    import torch

    host = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        host.to(device, copy=True)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def centred_mask(size: int, token: int, ratio: float) -> tuple[np.ndarray, float]:
    """A [size, size] mask repainting a centred square of whole tokens (`token` pixels a side),
    about `ratio` of them; and the share of tokens it repaints."""
    grid = size // token
    side = max(1, min(grid, round(grid * ratio**0.5)))
    lo = (grid - side) // 2 * token
    mask = np.zeros((size, size), np.float32)
    mask[lo:lo + side * token, lo:lo + side * token] = 1
    return mask, side * side / (grid * grid)
