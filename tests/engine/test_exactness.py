"""docs/architecture.md, invariant 2: the engine's result equals the plain diffusers
pipeline's, alone or batched with requests that join and leave at other steps."""

import pytest
import torch

from gouache.config import SchedulerConfig
from gouache.engine.core import EngineCore
from gouache.executor.pool import DevicePool
from gouache.metrics import Metrics
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.sched.policies import POLICIES, make_policy
from gouache.sched.scheduler import Scheduler
from tests.engine.conftest import DTYPE, as_state_latents, guidance_kwargs

FAMILIES = ["tiny-sd", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-qwen-image", "tiny-zimage", "tiny-flux2-klein"]
# Largest latent difference from the pipeline's: fp32 differs in summation order only (a batch's
# kernels are not one image's); bf16 rounds each of those orders to 8 bits of mantissa.
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25}  # bf16 on this CPU: up to 0.19 patched, 0.016 orca
TRAINED = ["shapes-unet", "shapes-dit"]
# Random-weight built-ins under the two batching modes; the trained models under every policy.
CASES = [(name, policy) for name in FAMILIES for policy in ("orca", "patched")] + [
    (name, policy) for name in TRAINED for policy in POLICIES if POLICIES[policy].min_devices == 1
]


class FlatCost:
    """Step times for the policies that plan with them: 0.1 s per image, patched or not."""

    def step_time(self, resolutions, patched, degree=1):
        return 0.1 * len(resolutions)


def request(rid: str, seed: int, steps: int, width: int = 64, height: int = 64, guidance: float = 5.0,
            prompt="a red fox"):
    return ImageRequest(rid, prompt, width, height, steps, guidance, seed, negative_prompt=None)


def reference_latents(pipe, r: ImageRequest) -> torch.Tensor:
    return as_state_latents(pipe, pipe(
        prompt=r.prompt, height=r.height, width=r.width, num_inference_steps=r.num_inference_steps,
        generator=torch.Generator().manual_seed(r.seed), output_type="latent",
        **guidance_kwargs(pipe, r.guidance_scale, r.negative_prompt),
    ).images)


def run_engine(pipe, arrivals: dict[int, list], policy: str = "orca", runner: ModelRunner | None = None,
               scheduler: Scheduler | None = None, pool: DevicePool | None = None) -> dict[str, torch.Tensor]:
    """Drive the engine loop step by step; `arrivals[k]` (requests, or (request, the inputs its
    preparation takes) pairs) join before step k; on `pool`'s runner if given. Returns final latents."""
    runner = pool.runner if pool else runner or ModelRunner(pipe, patch_pixels=32)  # 64 and 96 px: 2x2, 3x3 patches
    predictor = FlatCost() if POLICIES[policy].needs_predictor else None
    scheduler = scheduler or Scheduler(make_policy(SchedulerConfig(policy=policy), predictor))
    results = {}

    def keep_finished(report):
        for state in report.finished:
            results[state.request_id] = runner.states.pop(state.request_id).latents

    def no_drops(plan):  # pauses (service tiers) are fine
        if plan.drop:
            pytest.fail(f"dropped {plan.drop}")

    core = EngineCore(pool or DevicePool.in_process(runner), scheduler, Metrics(), keep_finished,
                      lambda reasons, invalid: pytest.fail(str(reasons)), no_drops,
                      lambda error: pytest.fail(str(error)))
    step = 0
    while step <= max(arrivals) or scheduler.has_work():
        for item in arrivals.get(step, []):
            request, inputs = item if isinstance(item, tuple) else (item, {})
            scheduler.add(runner.prepare(request, **inputs))
        core.step()
        step += 1
    return results


@pytest.mark.parametrize(("name", "policy"), CASES)
def test_engine_matches_pipeline_alone_and_in_a_changing_batch(pipes, name, policy, record_property):
    pipe = pipes(name)
    tolerance = TOLERANCE[DTYPE]
    alone = request("alone", seed=7, steps=4)
    main = request("main", seed=7, steps=4)
    # batch-mates: one already running, one joining mid-way, two of other (non-square) sizes,
    # one without CFG; under `patched` all sizes share one forward
    others = {
        0: [request("early", seed=1, steps=2, prompt="blue sky"), main],
        1: [request("wide", seed=2, steps=3, width=96), request("tall", seed=4, steps=2, height=96)],
        2: [request("nocfg", seed=3, steps=3, guidance=1.0), request("big", seed=5, steps=2, width=96, height=96)],
    }
    solo = run_engine(pipe, {0: [alone]}, policy)["alone"]
    batched = run_engine(pipe, others, policy)
    expected = reference_latents(pipe, alone)
    assert expected.abs().mean() > 0.1  # non-trivial latents
    errors = {"alone": (solo - expected).abs().max().item(), "main": (batched["main"] - expected).abs().max().item()}
    for r in [r for group in others.values() for r in group if r.request_id != "main"]:
        errors[r.request_id] = (batched[r.request_id] - reference_latents(pipe, r)).abs().max().item()
    record_property("max_error", max(errors.values()))  # --junitxml keeps it: gpu.sh reports them
    assert max(errors.values()) <= tolerance, errors
