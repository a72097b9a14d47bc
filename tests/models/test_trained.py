"""The shapes models trained here (`gouache train`): what they ship as, and that they draw what a
prompt asks (fixed seeds, judged by the checker)."""

import pytest

from gouache.bench.fidelity import Setup, generate
from gouache.data.checker import check
from gouache.data.prompts import Prompt
from gouache.data.shapes import parse_caption
from gouache.models import trained
from gouache.models.zoo import BUILTIN_MODELS, load_pipeline
from gouache.runner.describe import model_info

SHAPES_MODELS = [name for name in BUILTIN_MODELS if name.startswith("shapes-")]
BUDGET_MB = 25  # the limit on the repository's weights

# (caption, size, seed) that the checker accepted in `benchmarks/results/fidelity_NAME.json`
# (184 of 200 for the UNet, 190 for the DiT), one to three shapes; a change to the weights or to the
# models' numerics shows here.
DRAWN = {
    "shapes-unet": [
        ("a red circle at the top left on a gray background", (128, 128), 0),
        ("a blue circle at the bottom left and a yellow triangle at the right on a black background", (128, 128), 0),
        ("a blue triangle in the center, a purple square at the bottom right and a green triangle at the bottom "
         "on a white background", (128, 128), 0),
    ],
    "shapes-dit": [
        ("a purple circle at the top left on a gray background", (128, 128), 0),
        ("a cyan circle at the bottom left and a yellow square at the right on a black background", (128, 128), 0),
        ("a red square at the top, a yellow triangle at the top left and a cyan triangle at the bottom left on a "
         "black background", (128, 128), 0),
    ],
}


def test_the_weights_fit_the_budget_and_every_file_is_used():
    files = sorted(trained.WEIGHTS_DIR.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in files) <= BUDGET_MB * 2**20
    assert {f.stem for f in files} == {"shapes-vae", *SHAPES_MODELS}


@pytest.mark.parametrize("name", SHAPES_MODELS)
def test_model_info(name):
    info = model_info(load_pipeline(name), name)
    assert (info.default_size, info.default_steps) == (128, 20)
    assert info.size_step == (32 if name.startswith("shapes-unet") else 16)
    assert info.inpaint_channels == name.endswith("-inpaint")
    assert info.default_guidance == {"shapes-edit": 3.5}.get(name, trained.GUIDANCE)
    # shapes-edit's pipeline (FLUX.1 Kontext's) would generate, but the model learnt only edits
    assert (info.generation, info.instruction_edit) == ((False, True) if name == "shapes-edit" else (True, False))


@pytest.mark.parametrize("name", list(DRAWN))
def test_fixed_seed_generations_show_what_their_prompts_ask(name):
    prompts = [Prompt(parse_caption(text), *size, seed) for text, size, seed in DRAWN[name]]
    result = generate(name, Setup("fixed"), prompts)
    missed = [p.caption for p, image in zip(prompts, result.images) if not check(image, p.scene).all_ok]
    assert missed == []
