"""Reading adapter files (diffusers, kohya, metadata alphas, refusals), merging them in place
and back bit for bit, and the choice between merging and segmenting."""

import json

import pytest
import torch
from safetensors.torch import save_file

from gouache.adapter_names import LoraError, UnknownLora, lora_path
from gouache.lora.apply import Merged
from gouache.lora.files import METADATA_KEY, Target, parse_lora, random_lora, read_lora
from gouache.lora.runtime import Costs, choose
from gouache.models.zoo import load_pipeline

Q = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline("tiny-sd")


def layer_pair(pipe, rank=2):
    module = pipe.unet.get_submodule(Q)
    return torch.randn(rank, module.in_features), torch.randn(module.out_features, rank)


def test_kohya_keys_and_their_alphas_become_the_same_layer(pipe):
    down, up = layer_pair(pipe)
    peft = parse_lora({f"unet.{Q}.lora_A.weight": down, f"unet.{Q}.lora_B.weight": up}, {}, Target.of(pipe), "peft")
    key = "lora_unet_" + Q.replace(".", "_")
    kohya = parse_lora({f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up,
                        f"{key}.alpha": torch.tensor(1.0)},
                       {}, Target.of(pipe), "kohya")
    assert list(peft.layers) == list(kohya.layers) == [Q]
    assert torch.equal(peft.layers[Q].down, kohya.layers[Q].down) and torch.equal(peft.layers[Q].up, kohya.layers[Q].up)
    assert peft.layers[Q].scale == 1.0 and kohya.layers[Q].scale == 0.5  # alpha / rank


def test_metadata_alpha_and_patterns(pipe):
    down, up = layer_pair(pipe, rank=4)
    raw = {f"unet.{Q}.lora_A.weight": down, f"unet.{Q}.lora_B.weight": up}
    meta = {METADATA_KEY: json.dumps({"unet.r": 4, "unet.lora_alpha": 8})}
    assert parse_lora(raw, meta, Target.of(pipe), "x").layers[Q].scale == 2.0
    meta = {METADATA_KEY: json.dumps({"unet.r": 4, "unet.lora_alpha": 8, "unet.alpha_pattern": {"attn1.to_q": 2}})}
    assert parse_lora(raw, meta, Target.of(pipe), "x").layers[Q].scale == 0.5
    with pytest.raises(LoraError, match="DoRA"):
        parse_lora(raw, {METADATA_KEY: json.dumps({"unet.use_dora": True})}, Target.of(pipe), "x")


@pytest.mark.parametrize("raw, why", [
    ({"text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 8),
      "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 2)},
     r"do not fit encoder.layers.0.self_attn.q_proj \(linear 32 -> 32\)"),
    ({"text_encoder_2.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 32),
      "text_encoder_2.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, 2)},
     "has layers for text_encoder_2; gouache applies LoRAs to the unet and text_encoder of this model"),
    ({"lora_unet_down_blocks_1_attentions_0_proj_in.lokr_w1": torch.zeros(2, 2)}, "is a LoKr file, not a LoRA"),
    ({"lora_te_text_model_encoder_layers_0_mlp_fc1.hada_w1_a": torch.zeros(2, 2)}, "is a LoHa file, not a LoRA"),
    ({f"unet.{Q}.lora_A.weight": torch.zeros(2, 3), f"unet.{Q}.lora_B.weight": torch.zeros(3, 2)}, "do not fit"),
    ({f"unet.{Q}.lora_A.weight": torch.zeros(2, 32)}, "lora_A only"),
    ({"unet.no.such.module.lora_A.weight": torch.zeros(2, 8), "unet.no.such.module.lora_B.weight": torch.zeros(8, 2)},
     "no module"),
    ({f"unet.{Q}.lora_magnitude_vector": torch.zeros(32)}, r"is a DoRA \(lora_magnitude_vector keys\)"),
    ({"unet.down_blocks.1.attentions.0.norm.lora_A.weight": torch.zeros(2, 32),
      "unet.down_blocks.1.attentions.0.norm.lora_B.weight": torch.zeros(32, 2)}, "not a linear or conv"),
])
def test_adapters_that_do_not_fit_are_refused_with_the_reason(pipe, raw, why):
    with pytest.raises(LoraError, match=why):
        parse_lora(raw, {}, Target.of(pipe), "bad")


def test_names_stay_inside_the_directory(tmp_path):
    (tmp_path / "ok.safetensors").write_bytes(b"")
    assert lora_path(tmp_path, "ok") == tmp_path / "ok.safetensors"
    for name in ("../ok", "ok.safetensors", "/etc/passwd", "", "a" * 65, 3):
        with pytest.raises(LoraError, match="must match"):
            lora_path(tmp_path, name)
    with pytest.raises(UnknownLora, match="no missing.safetensors"):
        lora_path(tmp_path, "missing")
    with pytest.raises(UnknownLora, match="no --lora-dir"):
        lora_path(None, "ok")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_and_unmerge_restore_the_weights_bit_for_bit(tmp_path, dtype):
    pipe = load_pipeline("tiny-sd", dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    loras = []
    for seed in (1, 2):
        save_file(random_lora(pipe, seed=seed), str(tmp_path / f"{seed}.safetensors"))
        loras.append(read_lora(tmp_path / f"{seed}.safetensors", Target.of(pipe), str(seed)))
    before = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    merged = Merged.of(pipe.unet)
    assert merged is Merged.of(pipe.unet)  # one per denoiser: every runner of the model shares it
    for adapters in (((loras[0], 1.0),), ((loras[0], 0.5), (loras[1], -1.0)), ((loras[1], 2.0),)):
        assert merged.set(adapters)
        weight = pipe.unet.get_submodule(Q).weight
        expected = (before[f"{Q}.weight"].float() + sum(s * a.layers[Q].delta(weight) for a, s in adapters)).to(dtype)
        assert torch.equal(weight, expected)
    assert not merged.set(((loras[1], 2.0),))  # already merged: nothing to do
    merged.set(())
    assert all(torch.equal(v, before[k]) for k, v in pipe.unet.state_dict().items())


def test_choose_merges_a_shared_set_unless_segmenting_its_steps_left_is_cheaper():
    ink, paper = (("ink", 1.0, 0),), (("paper", 1.0, 0),)
    sizes = {"ink": 1000, "paper": 1000}
    unknown, costs = Costs(), Costs(merge_s_per_byte=1e-6, segment_s_per_row_byte=1e-8)
    assert choose([ink, paper], [2, 2], (), sizes, 10, costs, True) == "segmented"
    assert choose([ink, paper], [2, 2], (), sizes, 10, costs, False) == "split"
    assert choose([ink, ink], [2, 2], ink, sizes, 10, costs, True) == "merged"  # already merged
    assert choose([ink], [2], paper, sizes, 10, unknown, True) == "merged"  # nothing measured yet
    # switching moves 2000 bytes (2 ms); segmenting 2 rows x 2000 bytes x steps left (40 us a step)
    assert choose([ink], [2], paper, sizes, 100, costs, True) == "merged"
    assert choose([ink], [2], paper, sizes, 10, costs, True) == "segmented"
    assert choose([ink], [2], paper, sizes, 10, costs, False) == "merged"  # cannot segment: switch
    costs.observe("merge_s_per_byte", 0.0, 1000)
    assert costs.merge_s_per_byte == pytest.approx(0.7e-6)  # a running average


def test_text_encoder_layers_of_a_transformer_family_are_refused_naming_what_applies():
    """Text-encoder adapters are served for SD and SDXL (tested against diffusers), not SD3 / Flux."""
    pipe = load_pipeline("tiny-sd3")
    raw = {"text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 32),
           "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, 2)}
    with pytest.raises(LoraError,
                       match="has layers for text_encoder; gouache applies LoRAs to the transformer of this"):
        parse_lora(raw, {}, Target.of(pipe), "clip")


def test_a_kohya_dora_file_loads_as_plain_lora_as_diffusers_loads_it(pipe):
    """diffusers' SD / SDXL lora_state_dict drops kohya's `dora_scale` keys (with a warning)."""
    down, up = layer_pair(pipe)
    key = "lora_unet_" + Q.replace(".", "_")
    lora = parse_lora({f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up, f"{key}.alpha": torch.tensor(2.0),
                       f"{key}.dora_scale": torch.ones(1, down.shape[1])}, {}, Target.of(pipe), "dora")
    assert list(lora.layers) == [Q] and lora.layers[Q].scale == 1.0 and torch.equal(lora.layers[Q].down, down)
