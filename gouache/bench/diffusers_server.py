"""The server users build instead of gouache, for `gouache bench baselines`: a diffusers pipeline
behind a minimal FastAPI app, called the way its documentation shows (`pipe(prompt=...)`).

- `serial`: one request at a time under a lock;
- `static`: static batching: the first waiting request opens a batch, which takes every
  request of the same size and steps that arrives within `--window-ms` of it, up to
  `--max-batch`, and runs as one pipeline call (a list of prompts and generators); requests of
  other sizes wait for a later batch.

It answers POST /v1/images/generations (prompt, size, num_inference_steps, seed,
guidance_scale; non-streaming, b64 PNG), on a video pipeline POST /v1/videos (the same fields and
`num_frames`, `fps`: a clip, `output_type="np"`, encoded to MP4 by the encoder gouache uses; it
answers once the clip is made, `status` "completed"), and GET /health, enough for the load the
benchmark sends. Clips batch like images: equal size, frames and steps. It is a baseline, not a
product: no validation beyond what the load needs.

    python -m gouache.bench.diffusers_server --model shapes-unet --mode static --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import inspect
import io
import queue
import threading
import time
from dataclasses import dataclass, field

MODES = ("serial", "static")


@dataclass
class Job:
    prompt: str
    width: int
    height: int
    steps: int
    guidance: float
    seed: int
    frames: int = 1  # a clip's, on a video pipeline
    fps: int = 16
    arrived: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    encoded: bytes = b""  # the PNG, or the clip's MP4
    error: str | None = None

    @property
    def key(self) -> tuple:
        return self.width, self.height, self.frames, self.steps, self.guidance


def make_app(pipe, mode: str, window_s: float, max_batch: int):
    import numpy as np
    import torch
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from gouache.engine.video import encode_video

    video = "num_frames" in inspect.signature(pipe.__call__).parameters

    jobs: queue.Queue = queue.Queue()

    def run(batch: list[Job]) -> None:
        first = batch[0]
        clips = {"num_frames": first.frames, "output_type": "np"} if video else {}
        try:
            out = pipe(prompt=[j.prompt for j in batch], height=first.height, width=first.width,
                       num_inference_steps=first.steps, guidance_scale=first.guidance,
                       generator=[torch.Generator().manual_seed(j.seed) for j in batch], **clips)
            for job, made in zip(batch, out.frames if video else out.images):
                job.encoded = encode_video((made * 255).round().astype(np.uint8), job.fps) if video else png(made)
        except Exception as error:  # the load's requests are valid: an error here is the baseline's own
            for job in batch:
                job.error = f"{type(error).__name__}: {error}"
        for job in batch:
            job.done.set()

    def worker() -> None:
        held: list[Job] = []  # taken from the queue, of another size than the batch being filled
        while True:
            first = held.pop(0) if held else jobs.get()
            batch = [first]
            if mode == "static":
                batch += [j for j in held if j.key == first.key][: max_batch - 1]
                held = [j for j in held if j not in batch]
                deadline = first.arrived + window_s
                while len(batch) < max_batch and (left := deadline - time.monotonic()) > 0:
                    try:
                        job = jobs.get(timeout=left)
                    except queue.Empty:
                        break
                    (batch if job.key == first.key else held).append(job)
            run(batch)

    threading.Thread(target=worker, daemon=True).start()
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    async def made(body: dict, **clip) -> Job | JSONResponse:
        width, height = (int(v) for v in body.get("size", "512x512").split("x"))
        job = Job(body["prompt"], width, height, int(body.get("num_inference_steps", 20)),
                  float(body.get("guidance_scale", 3.0)), int(body.get("seed", 0)), **clip)
        jobs.put(job)
        await asyncio.get_running_loop().run_in_executor(None, job.done.wait)
        return JSONResponse({"error": {"message": job.error}}, status_code=500) if job.error else job

    @app.post("/v1/images/generations")
    async def generate(body: dict):
        job = await made(body)
        if isinstance(job, JSONResponse):
            return job
        return {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(job.encoded).decode()}]}

    @app.post("/v1/videos")
    async def create_video(body: dict):
        job = await made(body, frames=int(body.get("num_frames", 17)), fps=int(body.get("fps", 16)))
        if isinstance(job, JSONResponse):
            return job
        return {"id": f"video_{job.seed}", "object": "video", "status": "completed", "progress": 100,
                "bytes": len(job.encoded)}

    return app


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shapes-unet")
    parser.add_argument("--mode", choices=MODES, default="static")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--window-ms", type=float, default=50.0)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    args = parser.parse_args()
    import uvicorn

    from gouache.models.zoo import load_pipeline

    pipe = load_pipeline(args.model, args.dtype, args.device)
    pipe.set_progress_bar_config(disable=True)
    uvicorn.run(make_app(pipe, args.mode, args.window_ms / 1000, args.max_batch), host="127.0.0.1", port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
