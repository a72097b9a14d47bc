"""`gouache profile --reuse`: train the block cache's reuse predictor (PatchedServe §7) on this
model (`gouache serve --block-cache-predictor PATH`).

Runs `--requests` captions of the shapes caption distribution exactly (on a model that only
edits, instruction edits of shapes scenes, every kind in turn), each at `--reuse-steps` steps,
twice: in batches of one size (the cache's units are whole images) and in mixed-size
patched / packed batches (patches or token groups). At every block of every step it records
each unit's features (`block_cache.predictor.FEATURES`) and the error reusing the block's
previous output would have caused; a unit is labelled reusable when that error is under
`--bound`. Writes the predictor JSON with its held-out scores, and the samples beside it
(`.npz`) for other bounds.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import numpy as np


def run(args) -> int:
    import torch

    from gouache.block_cache.predictor import Recorder, train
    from gouache.block_cache.store import BlockCache
    from gouache.cli_flags import given, refuse_ignored
    from gouache.config import BlockCacheConfig
    from gouache.data.edits import EDIT_KINDS, sample_edit
    from gouache.data.shapes import caption, render, sample_scene
    from gouache.models.digest import model_digest
    from gouache.models.zoo import load_pipeline
    from gouache.request import ImageRequest
    from gouache.runner.describe import model_info
    from gouache.runner.model_runner import ModelRunner
    from gouache.sched.plan import Batch
    from gouache.uploads import Upload

    if args.requests < 2 or args.reuse_steps < 2:
        raise ValueError(f"--requests and --reuse-steps must be >= 2 (a unit needs a step before), "
                         f"got {args.requests} and {args.reuse_steps}")
    if not 0 < args.bound < 1:
        raise ValueError(f"--bound is a relative output error in (0, 1), got {args.bound}")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    pipe = load_pipeline(args.model, args.dtype, args.device)
    pipe.set_progress_bar_config(disable=True)
    info = model_info(pipe, args.model)
    recorder = Recorder()
    runner = ModelRunner(pipe, args.patch_size)
    if "patch_size" in given(args) and not runner.family.patches:
        refuse_ignored({"patch_size": f"{runner.family.name} models pack mixed sizes' tokens; patches are for UNets"})
    runner.cache = BlockCache(BlockCacheConfig(budget_bytes=1 << 40), recorder.pass_type())
    # Scenes of their own seed: `gouache bench fidelity` judges the predictor on other ones.
    rng = random.Random(f"reuse:{args.seed}")
    if info.generation:
        work = [(caption(sample_scene(rng)), None) for _ in range(args.requests)]
    else:  # (instruction, the scene it edits, its render's jitter)
        work = [(e.instruction, (e.source, rng.getrandbits(32)))
                for e in (sample_edit(rng, EDIT_KINDS[i % len(EDIT_KINDS)]) for i in range(args.requests))]
    start = time.perf_counter()
    for patched in (False, True):
        # Batches of one size each (whole-image units), or one of every size (patches, tokens).
        prompts = [(item, sizes[i % len(sizes)]) for i, item in enumerate(work)]
        if patched:
            batches = [prompts[i:i + len(sizes)] for i in range(0, len(prompts), len(sizes))]
        else:
            batches = [[p for p in prompts if p[1] == size] for size in sizes]
        for b, group in enumerate(batches):
            ids = []
            for i, ((text, source), size) in enumerate(group):
                rid = f"{'p' if patched else 'i'}{b}-{i}"
                upload = None if source is None else Upload(render(source[0], size, size, source[1]))
                runner.prepare(ImageRequest(rid, text, size, size, args.reuse_steps, info.default_guidance, args.seed,
                                            block_cache=1.0, image=None if upload is None else b"-"), upload=upload)
                ids.append(rid)
            for _ in range(args.reuse_steps):
                out = runner.execute(Batch(tuple(ids), patched=patched and len(group) > 1))
                if out.failed:
                    raise RuntimeError(f"profiling steps failed: {out.failed}")
            for rid in ids:
                runner.release(rid)
        print(f"{'patched' if patched else 'one size'}: {len(recorder.errors)} block calls recorded, "
              f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    features, errors = recorder.samples()
    predictor = train(features, errors, args.bound, model_digest(pipe), args.model, args.trees, args.depth,
                      seed=args.seed)
    predictor.report.update(requests=args.requests, prompts="captions" if info.generation else "instruction edits",
                            steps=args.reuse_steps, sizes=sizes,
                            profile_s=round(time.perf_counter() - start, 1))
    out = Path(args.out or f"benchmarks/results/reuse_{Path(args.model).name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    predictor.save(out)
    np.savez_compressed(out.with_suffix(".npz"), features=features, errors=errors)
    print(json.dumps(predictor.report, indent=2))
    print(f"wrote {out} and {out.with_suffix('.npz')}")
    return 0
