"""Every rule of which techniques go together is read from `gouache.techniques`: a made-up
technique added to the table is followed by the composer, server defaults, start-time flags,
admission's pair check and the docs with no other edit; the hand-written branches that once
decided it elsewhere are gone."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import gouache
from gouache import techniques
from gouache.forward_layers import Step
from gouache.runner.forward import ORDER, Forward
from gouache.techniques import EXACT, REFUSED, TABLE, TECHNIQUES, Pair, Technique

ROOT = Path(gouache.__file__).parent


@pytest.fixture
def watermark(monkeypatch):
    """A made-up server-chosen technique: refused with LoRA, exact with the rest, not compiled,
    turned on by --watermark, done without on several devices."""
    monkeypatch.setitem(TECHNIQUES, "watermark", Technique(
        "watermark", "--watermark", True, False, "a made-up watermark on every step", flags=("--watermark",),
        several_devices="ranks do not watermark"))
    for other in list(TECHNIQUES):
        if other != "watermark":
            verdict = REFUSED if other == "lora" else EXACT
            monkeypatch.setitem(TABLE, frozenset(("watermark", other)), Pair(verdict, f"made up with {other}"))
    return "watermark"


class Layer:
    def __init__(self, technique, uses=frozenset()):
        self.technique, self._uses = technique, frozenset(uses)

    def uses(self, step, state):
        return self._uses if state.name in ("marked", "both") else frozenset()

    def __call__(self, step, inner):
        return [torch.zeros(1) for _ in step.states] if self.technique == "layout" else inner(step)

    def rows(self, step, inner):
        return None


def test_a_made_up_technique_is_followed_by_every_reader_of_the_table(watermark):
    assert ("| `watermark` | `--watermark` | yes | no: the step runs eagerly | a made-up watermark"
            in techniques.markdown())
    assert "| `lora` + `watermark` | refused | made up with lora |" in techniques.markdown()

    uses = {"lora": {"lora"}, "layout": {"watermark"}}
    forward = Forward([Layer(name, uses.get(name, ())) for name in ORDER])
    state = SimpleNamespace(name="both", cond={}, request=SimpleNamespace(strength=None, num_frames=1),
                            latents=torch.zeros(1))
    with pytest.raises(ValueError, match="lora and watermark do not compose for one request: made up with lora"):
        forward.check(Step([state], patched=False))
    marked = SimpleNamespace(**{**vars(state), "name": "marked"})
    assert forward.eager_reason(Step([marked], patched=False)) == "watermark"

    assert not techniques.applies("watermark", {"lora", "img2img"})  # a server default keeps off LoRA requests
    assert techniques.applies("watermark", {"controlnet", "img2img"})
    assert techniques.refused_pair({"img2img", "lora", "watermark"})[:2] == ("lora", "watermark")
    assert techniques.unserved({}, "--policy x")["watermark"] == (
        "every step of --policy x runs on several devices, where ranks do not watermark")
    assert techniques.refused_flag({"--watermark": True}, "", {}, "--policy x") == (
        "--watermark would be ignored: every step of --policy x runs on several devices, where ranks do not watermark")
    assert techniques.refused_flag({"--watermark": True}, "sd", {}) is None


OLD_BRANCHES = (
    r"info\.(block_cache|templates)\b",  # admission's own flags for what a parallel server serves
    r"state\.control is None\s+and request\.strength",  # the runner deciding a default by hand
    r"control is not None or uses_template",
    r"several devices, where",  # start-time refusals written per flag
    r"\bcomposes\(",
)


def test_no_branch_outside_the_table_decides_whether_techniques_compose():
    found = []
    for path in ROOT.rglob("*.py"):
        if path.name == "techniques.py":
            continue
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}: {pattern}" for pattern in OLD_BRANCHES if re.search(pattern, text)]
    assert not found
