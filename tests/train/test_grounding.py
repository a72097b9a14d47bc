"""The grounding loss: which tokens name which shape, what the loss says of attention inside and
outside a shape, and a recording processor that changes no output."""

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import AttnProcessor2_0

from gouache.data.shapes import Scene, Shape, caption, render
from gouache.models import trained
from gouache.train.grounding import grounding_loss, phrase_tokens, record_cross_attention

SCENE = Scene(
    shapes=(Shape("circle", "red", "top left"), Shape("square", "blue", "center"),
            Shape("triangle", "green", "bottom")),
    background="white",
)


def test_phrase_tokens_are_the_colour_kind_and_position_words_of_each_shape():
    text = caption(SCENE)
    tokens = trained.tokenizer().convert_ids_to_tokens(trained.tokenizer()(text).input_ids)
    words = {colour: [tokens[i].lstrip("Ġ") for i in indices] for colour, indices in phrase_tokens(text)}
    assert words == {"red": ["red", "circle", "top", "left"], "blue": ["blue", "square", "center"],
                     "green": ["green", "triangle", "bottom"]}


def pixels_and_masks(width=96, height=64):
    image = torch.tensor(render(SCENE, width, height, seed=1)).permute(2, 0, 1).float()
    pixels = (image / 127.5 - 1)[None]
    masks = {s.colour: (image == torch.tensor(COLOUR[s.colour]).view(3, 1, 1)).all(0).float() for s in SCENE.shapes}
    return pixels, masks


COLOUR = {"red": (225, 30, 30), "blue": (30, 60, 230), "green": (30, 180, 40)}


def attention_maps(pixels, masks, inside: bool, h=4, w=6):
    """One [1, h*w, 32] map: each phrase token spreads its weight over its shape's cells (or over
    every other cell), other tokens spread uniformly."""
    probs = torch.full((1, h * w, 32), 1e-3)
    for colour, tokens in phrase_tokens(caption(SCENE)):
        cover = F.adaptive_max_pool2d(masks[colour][None, None], (h, w)).flatten()
        where = cover > 0 if inside else cover == 0
        for t in tokens:
            probs[0, :, t] = where.float()
    return [probs / probs.sum(-1, keepdim=True)]


def test_the_loss_is_low_inside_the_shapes_and_high_outside():
    pixels, masks = pixels_and_masks()
    text = [caption(SCENE)]
    inside = grounding_loss(attention_maps(pixels, masks, inside=True), pixels, text)
    outside = grounding_loss(attention_maps(pixels, masks, inside=False), pixels, text)
    uniform = grounding_loss([torch.full((1, 24, 32), 1 / 32)], pixels, text)
    assert inside == pytest.approx(0.0, abs=0.01) and 0.5 < uniform < outside == pytest.approx(1.0, abs=0.01)


def test_dropped_captions_add_nothing():
    pixels, _ = pixels_and_masks()
    assert grounding_loss([torch.rand(1, 24, 32)], pixels, [""]).item() == 0.0


def test_recording_changes_no_output_and_keeps_one_map_per_cross_attention():
    torch.manual_seed(0)
    unet = trained.unet()
    unet.set_attn_processor(AttnProcessor2_0())
    latents, embeds, t = (torch.randn(2, 4, 8, 12), torch.randn(2, trained.TEXT_LENGTH, trained.TEXT_HIDDEN),
                          torch.tensor([999, 10]))
    with torch.no_grad():
        plain = unet(latents, t, encoder_hidden_states=embeds).sample
        recorder = record_cross_attention(unet)
        recorded = unet(latents, t, encoder_hidden_states=embeds).sample
    # the recorder's explicit softmax attention rounds otherwise than SDPA: 1.07e-6 was seen under CI's load
    torch.testing.assert_close(recorded, plain, rtol=1e-5, atol=1e-5)
    cross = [name for name in unet.attn_processors if name.endswith("attn2.processor")]
    assert len(recorder.maps) == len(cross) > 0
    assert all(m.shape[0] == 2 and m.shape[2] == trained.TEXT_LENGTH for m in recorder.maps)
    torch.testing.assert_close(recorder.maps[0].sum(-1), torch.ones_like(recorder.maps[0].sum(-1)))
