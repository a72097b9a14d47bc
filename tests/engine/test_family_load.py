"""A live mixed load of every family's request kinds (issue 37): generations of two sizes, masked
edits, img2img, instruction edits and edits of several images, all submitted at once to a running
engine under `orca` and `patched`; every request comes back, at its size, none failed."""

import asyncio
import io
import time

import numpy as np
import pytest
from PIL import Image

from gouache.config import EngineConfig, SchedulerConfig
from gouache.engine.client import AsyncEngine
from gouache.request import ImageRequest
from gouache.runner.describe import model_info
from gouache.sched.policies import make_policy

MODELS = ["tiny-sd", "tiny-sdxl-inpaint", "tiny-sd3", "tiny-flux", "tiny-flux-kontext", "tiny-qwen-image",
          "tiny-qwen-image-edit-plus", "tiny-zimage", "tiny-flux2-klein"]


def png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def kinds(info) -> list[ImageRequest]:
    """One request of each kind the model takes (`ModelInfo`), two steps each."""
    rng = np.random.default_rng(0)
    upload, other = (png(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)),
                     png(rng.integers(0, 255, (80, 64, 3), dtype=np.uint8)))
    mask = np.full((64, 64, 4), 255, np.uint8)
    mask[16:48, 16:48, 3] = 0  # transparent: repaint
    now = time.monotonic()

    def request(kind: str, width: int = 64, **fields) -> ImageRequest:
        return ImageRequest(f"{kind}-0", f"a {kind}", width, 64, 2, info.default_guidance, seed=len(kind),
                            arrival_time=now, **fields)

    out = [request("masked", image=upload, mask=png(mask))]
    if info.generation:
        out += [request("square"), request("wide", 96)]
    if info.img2img:
        out.append(request("img2img", image=upload, strength=0.5))
    if info.instruction_edit:
        out.append(request("instruction", image=upload))
    if info.max_input_images > 1:
        out.append(request("several", image=upload, references=(other,)))
    return out


@pytest.mark.parametrize("policy", ["orca", "patched"])
@pytest.mark.parametrize("name", MODELS)
def test_a_mixed_load_of_every_kind_loses_nothing(pipes, name, policy):
    pipe = pipes(name)
    info = model_info(pipe, name)
    engine = AsyncEngine(pipe, info, EngineConfig(), make_policy(SchedulerConfig(policy=policy, max_batch_size=8)))
    requests = kinds(info)

    async def scenario():
        await engine.start()
        handles = [await engine.submit([r]) for r in requests]
        results = [await handle.images() for handle in handles]
        await engine.aclose()
        return results

    results = asyncio.run(scenario())
    sizes = [Image.open(io.BytesIO(events[0].image)).size for events in results]
    assert sizes == [(r.width, r.height) for r in requests]
    stats = engine.stats()
    assert (stats.finished, stats.failed) == (len(requests), 0)
