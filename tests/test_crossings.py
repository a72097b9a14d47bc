"""Where a request's `loras`, its service tier and an edit's mask travel on the serving path
(issue 58): the files whose code names each (names only: strings and comments do not count;
benchmarks, the simulator, training and profiling build requests of their own and are left
out). A new file that starts passing one of them along shows up here; take the value from the
object that carries it (`ImageRequest`, `Upload`, `EditInputs`) instead, or add the file with
the reason."""

import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEFT_OUT = ("bench", "sim", "train", "data", "profile")

EDIT_MASK = {"mask", "mask_bytes", "mask_image", "pixel_mask", "latent_mask", "token_mask", "edit_mask", "EditMask",
             "repaint_ratio", "_repaint_region", "masked_image_latents"}
EXPECTED = {
    # the API field, the request's field, the runner's LoRA runtime entry, the template key, the
    # adapter check before admission
    "loras": ({"loras"}, {"api/protocol.py", "request.py", "runner/model_runner.py", "templates/replay.py",
                          "engine/adapters.py"}),
    # the API field only: from there on it is a `Tier`
    "service_tier": ({"service_tier"}, {"api/protocol.py"}),
    # entries (HTTP, CLI), the request's bytes, the decoder, the type, the router's ratio, and on
    # the runner the forms' readers: blend and composite (base), the 9-channel UNet's input, the
    # template's token form (model_runner), and `EditInputs` that holds it
    "mask": (EDIT_MASK, {"api/images.py", "api/protocol.py", "offline.py", "request.py", "engine/imaging.py",
                         "uploads.py", "replicas/routing.py", "runner/families/base.py", "runner/families/unet.py",
                         "runner/model_runner.py", "runner/sampler.py"}),
}


def _names(path: Path) -> set[str]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return {t.string for t in tokens if t.type == tokenize.NAME}


def _files() -> dict[str, set[str]]:
    package = ROOT / "gouache"
    return {str(p.relative_to(package)): _names(p) for p in package.rglob("*.py")
            if p.relative_to(package).parts[0] not in LEFT_OUT}


@pytest.mark.parametrize("what", EXPECTED)
def test_a_value_travels_only_through_the_files_that_use_it(what):
    names, expected = EXPECTED[what]
    files = _files()
    found = {f for f, seen in files.items() if names & seen}
    assert found == expected, f"{what}: new {sorted(found - expected)}, gone {sorted(expected - found)}"
