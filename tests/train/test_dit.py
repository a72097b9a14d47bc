import torch

from gouache.models import trained
from gouache.models.zoo import shapes_sd3
from gouache.train.dit import ZERO_TOKENS, CollapsedJointAttention, collapsed_inputs

CAPTIONS = ["a red circle at the top left on a white background", ""]


def test_the_pipeline_appends_256_zero_tokens_when_the_model_has_no_t5():
    assert ZERO_TOKENS == 256


def test_one_token_with_log_n_bias_equals_the_pipelines_n_zero_tokens():
    torch.manual_seed(0)
    text_encoder, transformer = trained.text_encoder(with_projection=True, layers=3), trained.dit()
    pipe = shapes_sd3(trained.vae(), text_encoder, transformer)
    latents = torch.randn(2, 4, 8, 12)
    timestep = torch.tensor([900.0, 120.0])
    with torch.no_grad():
        full, _, pooled, _ = pipe.encode_prompt(prompt=CAPTIONS, prompt_2=None, prompt_3=None,
                                                do_classifier_free_guidance=False)
        assert full.shape[1] == trained.TEXT_LENGTH + ZERO_TOKENS
        reference = transformer(hidden_states=latents, encoder_hidden_states=full, pooled_projections=pooled,
                                timestep=timestep).sample
        embeds, collapsed_pooled, key_bias = collapsed_inputs(pipe, CAPTIONS)
        torch.testing.assert_close(embeds, full[:, : trained.TEXT_LENGTH + 1])
        torch.testing.assert_close(collapsed_pooled, pooled)
        for processor in (CollapsedJointAttention(), CollapsedJointAttention(record=True)):
            transformer.set_attn_processor(processor)
            collapsed = transformer(
                hidden_states=latents, encoder_hidden_states=embeds, pooled_projections=pooled, timestep=timestep,
                joint_attention_kwargs={"key_bias": key_bias},
            ).sample
            torch.testing.assert_close(collapsed, reference, rtol=1e-4, atol=1e-5)
    # the recording one kept each block's image-to-text attention: [B, 4 x 6 patches, text tokens + the zero one]
    assert [m.shape for m in processor.maps] == [(2, 24, trained.TEXT_LENGTH + 1)] * transformer.config.num_layers
    assert all(0 < m.sum(-1).min() and m.sum(-1).max() < 1 for m in processor.maps)  # the rest goes to image keys
