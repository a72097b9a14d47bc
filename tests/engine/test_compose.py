"""docs/architecture.md, "The compatibility table" and invariant 6: every pair of techniques
composes as `gouache.techniques.TABLE` says, under every policy of one device, and an exact
request's image does not depend on what shares its batch.

The pairs a CPU runner serves in one process (LoRA, ControlNet, block cache, templates, mixed
sizes) are served here; the parallel pairs on two worker processes are in
`tests/parallel/test_cfg.py`; refused pairs are refused at admission, naming both fields.
"""

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from gouache.api.protocol import ImageEditRequest, ImageGenerationRequest
from gouache.config import BlockCacheConfig, ControlNetConfig, LoraConfig, TemplateConfig
from gouache.controlnet.model import random_controlnet
from gouache.errors import InvalidRequestError
from gouache.request import ImageRequest
from gouache.runner.model_runner import ModelRunner
from gouache.sched.plan import Batch
from gouache.sched.policies import POLICIES
from gouache.techniques import EXACT, REFUSED, TABLE, TECHNIQUES, markdown, pair
from gouache.uploads import EditMask, Upload
from tests.api.fake_engine import FAKE_INFO
from tests.api.test_protocol import CONTEXT
from tests.engine.test_exactness import run_engine
from tests.lora.random_files import random_loras

MODEL = "tiny-sd"
STEPS = 2
ONE_DEVICE = [name for name, cls in POLICIES.items() if cls.min_devices == 1]
# in one process, here
SERVED = ("lora", "controlnet", "block_cache", "template", "mixed_sizes", "img2img", "conditioning")
SERVER_CHOSEN = {"mixed_sizes", "conditioning"}  # the batch's layout; the conditioning cache of the batched runs
TOLERANCE = 1e-4  # fp32 on the CPU: another batch layout rounds otherwise (docs/architecture.md, invariant 2)


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    from gouache.models.zoo import load_pipeline

    loras, controls = random_loras(tmp_path_factory.mktemp("loras"), MODEL), tmp_path_factory.mktemp("controlnets")
    random_controlnet(load_pipeline(MODEL), seed=0, std=0.2).save_pretrained(str(controls / "edges"))
    return str(loras), str(controls)


def member(rid: str, uses: tuple[str, ...], seed: int, size: int = 64, lora: str = "ink") -> tuple[ImageRequest, dict]:
    """A request using `uses` (of SERVED but SERVER_CHOSEN), one prompt for all, and the inputs
    its preparation takes (the decoded upload, mask and ControlNet images)."""
    request = ImageRequest(rid, "a red fox", size, size, STEPS, 5.0, seed)
    inputs = {}
    rng = np.random.default_rng(size)
    if "lora" in uses:
        request = replace(request, loras=((lora, 0.8),))
    if "controlnet" in uses:
        request = replace(request, controlnets=(("edges", b"", 0.8),))
        inputs["controls"] = [rng.integers(0, 255, (size, size, 3), dtype=np.uint8)]
    if "block_cache" in uses:
        request = replace(request, block_cache=0.5)
    if "img2img" in uses:
        request = replace(request, image=b"-", strength=0.7)
        inputs["upload"] = Upload(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
    if "template" in uses:
        request = replace(request, image=b"-", template_cache=True, template_id=f"shirt-{size}")
        mask = np.zeros((size, size), np.float32)
        mask[: size // 2] = 1.0
        inputs["upload"] = Upload(rng.integers(0, 255, (size, size, 3), dtype=np.uint8), EditMask(mask))
    return request, inputs


def exact(request: ImageRequest) -> bool:
    return not request.block_cache and not request.template_cache


def serve(pipe, directories, policy: str, arrivals: dict[int, list[tuple[ImageRequest, dict]]],
          conditioning: bool = True, block_cache=None) -> dict[str, torch.Tensor]:
    """Final latents of every request, `arrivals[k]` joining before step k, on a fresh runner
    (with the conditioning cache, which the runs alone go without)."""
    loras, controls = directories
    runner = ModelRunner(pipe, patch_pixels=32, lora=LoraConfig(loras), controlnet=ControlNetConfig(controls),
                         conditioning_bytes=(64 << 20) if conditioning else 0, block_cache=block_cache)
    try:
        latents = run_engine(pipe, arrivals, policy, runner)
    finally:
        runner.close()
    if conditioning and sum(map(len, arrivals.values())) > 1:  # one prompt for all: the encoders ran once
        assert runner.conditioning.take_report().lookups[("text", "hit")] > 0
    return latents


class Alone:
    """Each request's latents served alone (by `orca`, one request per step), computed once."""

    def __init__(self, pipe, directories):
        self.pipe, self.directories, self.done = pipe, directories, {}

    def __call__(self, request: ImageRequest, inputs: dict) -> torch.Tensor:
        key = replace(request, request_id="alone", arrival_time=0.0)
        name = repr(key)
        if name not in self.done:
            self.done[name] = serve(self.pipe, self.directories, "orca", {0: [(key, inputs)]},
                                    conditioning=False)["alone"]
        return self.done[name]


@pytest.fixture(scope="module")
def alone(pipes, directories):
    return Alone(pipes(MODEL), directories)


def pairs(verdicts: set[str]) -> list[tuple[str, str]]:
    return [tuple(name for name in TECHNIQUES if name in p) for p, entry in TABLE.items()
            if p <= set(SERVED) and entry.verdict in verdicts]


def test_the_table_has_one_entry_per_pair_of_techniques():
    names = list(TECHNIQUES)
    assert len(TABLE) == len(names) * (len(names) - 1) // 2
    assert all(len(p) == 2 and p <= set(names) for p in TABLE)
    # an exact pair is of exact techniques only
    assert all(TECHNIQUES[a].exact and TECHNIQUES[b].exact for a, b in map(tuple, TABLE) if pair(a, b).verdict == EXACT)


@pytest.mark.parametrize("decider", ["threshold", "predictor"])
@pytest.mark.parametrize("policy", ONE_DEVICE)
def test_every_pair_composes_as_the_table_says(pipes, directories, alone, policy, decider, tmp_path):
    """One batch walks every pair served in one process that composes: a request of each
    technique and of both (where both are a request's), in two sizes (which mixing policies
    patch or pack into one forward) and two adapter sets, beside plain requests. Every request
    ends, and every exact one equals itself served alone. The block cache decides by its
    threshold, or by a reuse predictor that lets every unit reuse."""
    from tests.engine.test_block_cache import reuse_everywhere

    config = None
    if decider == "predictor":
        config = BlockCacheConfig(predictor=reuse_everywhere(pipes(MODEL), tmp_path / "reuse.json"))
    composing = pairs({EXACT, "approximate"})
    kinds = {(t,) for t in SERVED if t not in SERVER_CHOSEN} | {()}
    kinds |= {(a, b) for a, b in composing if not {a, b} & SERVER_CHOSEN}
    batch = [member(f"{'+'.join(uses) or 'plain'}-{size}", uses, seed=seed, size=size, lora=lora)
             for seed, uses in enumerate(sorted(kinds)) for size, lora in ((64, "ink"), (96, "paper"))]
    latents = serve(pipes(MODEL), directories, policy, {0: batch}, block_cache=config)
    assert set(latents) == {r.request_id for r, _ in batch}
    for a, b in composing:
        own = {a, b} - SERVER_CHOSEN
        members = [(r, i) for r, i in batch if own <= set(r.request_id.split("-")[0].split("+"))]
        assert members, (a, b)
        for request, inputs in members:
            assert torch.isfinite(latents[request.request_id]).all(), (a, b, request.request_id)
            if exact(request):
                difference = (latents[request.request_id] - alone(request, inputs)).abs().max()
                assert difference <= TOLERANCE, (a, b, request.request_id, float(difference))


def edit_body(fields: dict) -> dict:
    return {"prompt": "p", "size": "256x256", **fields}


FIELDS = {  # the request fields that ask for each technique a request can ask for
    "lora": {"loras": [{"name": "ink"}]},
    "controlnet": {"controlnets": [{"name": "edges", "image": "data:image/png;base64,AA=="}]},
    "controlnet_async": {"controlnets": [{"name": "edges", "image": "data:image/png;base64,AA=="}],
                         "controlnet_mode": "async"},
    "block_cache": {"block_cache": 0.1},
    "template": {"template_cache": True},
    "img2img": {"strength": 0.5},
}


ASKED = {"controlnet_async": "controlnets"}  # the field named for it: controlnet_mode only says how they run


def test_refused_pairs_are_refused_at_admission_naming_both_fields():
    refused = [tuple(name for name in TECHNIQUES if name in p) for p, entry in TABLE.items()
               if entry.verdict == REFUSED]
    # a clip's refusals are the videos route's, which takes none of those fields (tests/api/test_videos.py)
    per_request = [(a, b) for a, b in refused if TECHNIQUES[a].per_request and TECHNIQUES[b].per_request
                   and "clip" not in (a, b)]
    assert len(per_request) == 9
    for a, b in per_request:
        # "reference" is asked by an upload without a mask to an instruction-edit model
        info = replace(FAKE_INFO, instruction_edit="reference" in (a, b))
        image = b"upload" if "reference" in (a, b) else None
        params = ImageEditRequest.model_validate(edit_body({**FIELDS.get(a, {}), **FIELDS.get(b, {})}), context=CONTEXT)
        with pytest.raises(InvalidRequestError) as error:
            params.to_requests("x", info, 0.0, image)
        message, fields = error.value.message, (ASKED.get(a, TECHNIQUES[a].field), ASKED.get(b, TECHNIQUES[b].field))
        if "reference" in (a, b):
            other = fields[0] if b == "reference" else fields[1]
            assert f"an edit on 'fake-sd' (its upload enters as reference tokens) and {other} do not compose" in message
        else:
            assert f"{fields[0]} and {fields[1]} do not compose" in message, (a, b, message)
        assert error.value.param in fields
        for one in (a, b):  # each alone is taken
            alone_params = ImageEditRequest.model_validate(edit_body(FIELDS.get(one, {})), context=CONTEXT)
            alone_info = replace(FAKE_INFO, instruction_edit=one == "reference")
            assert alone_params.to_requests("x", alone_info, 0.0, image if one == "reference" else None)
    generation = ImageGenerationRequest.model_validate(edit_body({**FIELDS["controlnet"], **FIELDS["block_cache"]}),
                                                       context=CONTEXT)
    with pytest.raises(InvalidRequestError, match="controlnets and block_cache do not compose"):
        generation.to_requests("x", FAKE_INFO, 0.0)


def test_a_refused_pair_never_reaches_a_forward(pipes, directories):
    """The composer's last guard: a patched batch on several devices (mixed_sizes with parallel,
    which no policy plans) is refused before anything runs, as is a request that asks for a
    ControlNet and the block cache past admission."""
    runner = ModelRunner(pipes(MODEL), controlnet=ControlNetConfig(directories[1]))
    request, inputs = member("a", (), seed=0)
    runner.prepare(request, **inputs)
    with pytest.raises(ValueError, match="mixed_sizes and parallel do not compose"):
        runner.execute(Batch(("a",), (0, 1), 2, patched=True), group=None)
    request, inputs = member("b", ("controlnet", "block_cache"), seed=0)
    runner.prepare(request, **inputs)
    with pytest.raises(ValueError, match="controlnet and block_cache do not compose"):
        runner.execute(Batch(("b",)))
    assert runner.states["a"].step == runner.states["b"].step == 0


def test_a_server_default_applies_only_where_it_composes(pipes, directories):
    """--block-cache's threshold does not apply to a ControlNet request (it would be refused)."""
    runner = ModelRunner(pipes(MODEL), block_cache=BlockCacheConfig(threshold=0.5),
                         controlnet=ControlNetConfig(directories[1]))
    request, inputs = member("c", ("controlnet",), seed=0)
    runner.prepare(request, **inputs)
    assert runner.states["c"].request.block_cache == 0.0
    assert not runner.execute(Batch(("c",))).failed


def test_a_template_default_keeps_off_an_edit_that_asks_for_the_block_cache(pipes, directories, tmp_path):
    """--template-cache's default does not apply to an edit asking for the block cache (a refused
    pair): before, the edit took both and its step raised at the composer's guard."""
    runner = ModelRunner(pipes(MODEL), templates=TemplateConfig(default=True, directory=str(tmp_path)))
    request, inputs = member("d", ("template",), seed=0)
    runner.prepare(replace(request, template_cache=None, template_id=None, block_cache=0.5), **inputs)
    assert runner.states["d"].template is None and runner.states["d"].request.block_cache == 0.5
    assert not runner.execute(Batch(("d",))).failed


KINDS = [(), ("lora",), ("controlnet",), ("block_cache",), ("template",), ("img2img",), ("lora", "controlnet"),
         ("lora", "block_cache"), ("lora", "template"), ("lora", "img2img"), ("controlnet", "img2img")]


@pytest.mark.parametrize("policy", ONE_DEVICE)
def test_an_exact_request_is_the_same_in_any_random_mix(pipes, directories, alone, policy):
    """Seeded random mixes of sizes, adapters, ControlNets, img2img, cached and templated
    neighbours, joining at random steps: every exact request equals itself served alone."""
    pipe = pipes(MODEL)
    draw = random.Random(f"mix-{policy}")
    for mix in range(2):
        arrivals: dict[int, list] = {}
        for i in range(4):
            uses = draw.choice(KINDS)
            request, inputs = member(f"m{mix}-{i}", uses, seed=draw.randrange(2), size=draw.choice((64, 96)),
                                     lora=draw.choice(("ink", "paper")))
            arrivals.setdefault(draw.randrange(3), []).append((request, inputs))
        if not any(exact(r) for batch in arrivals.values() for r, _ in batch):
            arrivals.setdefault(0, []).append(member(f"m{mix}-plain", (), seed=1))
        latents = serve(pipe, directories, policy, arrivals)
        for request, inputs in (item for batch in arrivals.values() for item in batch):
            if exact(request):
                difference = (latents[request.request_id] - alone(request, inputs)).abs().max()
                assert difference <= TOLERANCE, (policy, mix, request, float(difference))


def test_the_architecture_page_shows_the_table_of_the_code():
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    assert markdown() in page
