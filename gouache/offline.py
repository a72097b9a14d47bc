"""`gouache generate` / `gouache edit`: one image, in this process, with a progress bar."""

from __future__ import annotations

import os
from pathlib import Path

from tqdm import tqdm

from gouache.cli_flags import refuse_ignored
from gouache.engine.imaging import DecodeError, decode_edit, encode_image, read_size
from gouache.errors import WorkerFailureError
from gouache.request import ImageRequest
from gouache.sched.plan import Batch

_EXTENSIONS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}


def run_offline(args) -> None:
    from gouache.models.zoo import load_pipeline, model_id
    from gouache.runner.describe import model_info
    from gouache.runner.model_runner import ModelRunner

    output_format = _EXTENSIONS.get(Path(args.output).suffix.lower())
    if output_format is None:
        raise ValueError(f"output file must end in one of {', '.join(_EXTENSIONS)}, got {args.output!r}")
    pipe = load_pipeline(args.model, args.dtype, args.device)
    pipe.set_progress_bar_config(disable=True)
    info = model_info(pipe, model_id(args.model))
    image_bytes = Path(args.image).read_bytes() if getattr(args, "image", None) else None
    height, width = args.size or _upload_size(image_bytes) or (info.default_size, info.default_size)
    if width % info.size_step or height % info.size_step:
        raise ValueError(f"size must be a multiple of {info.size_step} pixels per side, got {width}x{height}")
    if image_bytes is None and not info.generation:
        raise ValueError(f"{args.model} edits images and makes none from text alone: use `gouache edit` with --image")
    if (args.steps or info.default_steps) < info.min_steps:
        raise ValueError(f"{args.model} (a {info.family} model) takes at least {info.min_steps} steps, "
                         f"got {args.steps}")
    request = ImageRequest(
        request_id="offline-0",
        prompt=args.prompt,
        width=width,
        height=height,
        num_inference_steps=args.steps or info.default_steps,
        guidance_scale=info.default_guidance if args.guidance is None else args.guidance,
        seed=args.seed,
        negative_prompt=args.negative_prompt,
        output_format=output_format,
        image=image_bytes,
        mask=Path(args.mask).read_bytes() if getattr(args, "mask", None) else None,
    )
    upload = None
    if request.is_edit:
        upload = decode_edit(request, 4096 * 4096)
        if isinstance(upload, DecodeError):
            raise ValueError(upload.message)
    runner = ModelRunner(pipe)
    if request.negative_prompt and not runner.family.uses_cfg(request):
        refuse_ignored({"negative_prompt": f"{args.model} at guidance {request.guidance_scale} runs without "
                                           "classifier-free guidance (FLUX is guidance-distilled; Z-Image needs "
                                           "--guidance > 0, the others --guidance > 1)"})
    state = runner.prepare(request, upload)
    for _ in tqdm(range(state.num_steps), desc="denoising", unit="step", disable=os.environ.get("CI") == "true"):
        failed = runner.execute(Batch((request.request_id,))).failed
        if failed:
            raise WorkerFailureError(f"denoising failed: {failed[request.request_id]}")
    Path(args.output).write_bytes(encode_image(runner.decode(request.request_id), output_format))
    print(f"wrote {args.output} ({width}x{height}, {request.num_inference_steps} steps, seed {args.seed})")


def _upload_size(image_bytes: bytes | None) -> tuple[int, int] | None:
    """An edit keeps its image's size unless --size says otherwise (as the API does)."""
    if image_bytes is None:
        return None
    size = read_size(image_bytes, "image")
    if isinstance(size, DecodeError):
        raise ValueError(size.message)
    width, height = size
    return height, width
