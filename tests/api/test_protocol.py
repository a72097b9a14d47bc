"""Request validation and the file store, without a server."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from gouache.api.errors import from_validation_errors
from gouache.api.file_store import FileStore
from gouache.api.protocol import ImageEditRequest, ImageGenerationRequest
from gouache.api.request_fields import MAX_SEED, Limits
from gouache.errors import InvalidRequestError
from gouache.techniques import unserved
from tests.api.fake_engine import FAKE_INFO

LIMITS = Limits(max_n=4, max_steps=50, min_size=64, max_size=1024, max_pixels=512 * 1024, size_step=16,
                default_size=512)
CONTEXT = {"limits": LIMITS}


def _json_error(body: str):
    with pytest.raises(ValidationError) as caught:
        ImageGenerationRequest.model_validate_json(body, strict=True, context=CONTEXT)
    return from_validation_errors(caught.value.errors())


def _form_error(fields: dict[str, str]):
    with pytest.raises(ValidationError) as caught:
        ImageEditRequest.model_validate(fields, context=CONTEXT)
    return from_validation_errors(caught.value.errors())


@pytest.mark.parametrize(
    ("field", "json_value", "form_value"),
    [("n", "5", "5"), ("size", '"1000x1000"', "1000x1000"), ("size", '"1024x1024"', "1024x1024"),
     ("num_inference_steps", "51", "51"), ("guidance_scale", "-0.5", "-0.5"), ("seed", "-3", "-3")],
)  # fmt: skip
def test_json_and_form_share_rules_and_messages(field: str, json_value: str, form_value: str):
    json_error = _json_error(f'{{"prompt": "p", "{field}": {json_value}}}')
    form_error = _form_error({"prompt": "p", field: form_value})
    assert json_error.param == form_error.param == field
    assert json_error.message.split(" (got")[0] == form_error.message.split(" (got")[0]


def test_limits_come_from_context():
    assert "between 1 and 4" in _json_error('{"prompt": "p", "n": 5}').message
    assert "multiples of 16" in _json_error('{"prompt": "p", "size": "520x520"}').message
    assert "at most 524288 pixels" in _json_error('{"prompt": "p", "size": "1024x1024"}').message


def test_form_values_are_parsed_from_strings():
    fields = {"prompt": "p", "n": "2", "stream": "true", "guidance_scale": "7.5", "seed": "9", "size": "512x256"}
    params = ImageEditRequest.model_validate(fields, context=CONTEXT)
    assert ((params.n, params.stream, params.guidance_scale, params.seed, params.width_height)
            == (2, True, 7.5, 9, (512, 256)))


def test_to_requests_fills_defaults_and_seeds():
    params = ImageGenerationRequest.model_validate({"prompt": "p", "n": 3}, context=CONTEXT)
    requests = params.to_requests("img_x", FAKE_INFO, arrival=1.0)
    assert [r.request_id for r in requests] == ["img_x-0", "img_x-1", "img_x-2"]
    assert [r.seed - requests[0].seed for r in requests] == [0, 1, 2]
    assert (requests[0].width, requests[0].num_inference_steps, requests[0].partial_images) == (512, 4, 0)


def test_seeds_of_n_images_wrap_to_stay_valid():
    params = ImageGenerationRequest.model_validate({"prompt": "p", "n": 3, "seed": MAX_SEED}, context=CONTEXT)
    seeds = [r.seed for r in params.to_requests("a", FAKE_INFO, 0.0)]
    assert seeds == [MAX_SEED, 0, 1]
    for seed in seeds:  # each, sent back with n=1, is accepted and makes the same image
        again = ImageGenerationRequest.model_validate({"prompt": "p", "seed": seed}, context=CONTEXT)
        assert again.to_requests("b", FAKE_INFO, 0.0)[0].seed == seed


@pytest.mark.parametrize("info_changes, guidance, why", [
    ({"uses_cfg": False, "name": "fake-flux"}, None, "guidance-distilled"),
    ({}, 1.0, "guidance_scale 1 turns classifier-free guidance off"),
])
def test_a_negative_prompt_that_would_be_ignored_is_refused(info_changes, guidance, why):
    """Before: FLUX and guidance <= 1 dropped the negative prompt without a word."""
    body = {"prompt": "p", "negative_prompt": "blurry", **({} if guidance is None else {"guidance_scale": guidance})}
    params = ImageGenerationRequest.model_validate(body, context=CONTEXT)
    with pytest.raises(InvalidRequestError) as refused:
        params.to_requests("a", dataclasses.replace(FAKE_INFO, **info_changes), 0.0)
    assert refused.value.param == "negative_prompt" and why in refused.value.message


def test_slo_ms_is_refused_where_the_policy_ignores_deadlines():
    """Before: orca, patched and fcfs-static accepted slo_ms and never looked at it."""
    params = ImageGenerationRequest.model_validate({"prompt": "p", "slo_ms": 500}, context=CONTEXT)
    with pytest.raises(InvalidRequestError) as refused:
        params.to_requests("a", dataclasses.replace(FAKE_INFO, deadlines=False), 0.0)
    assert refused.value.param == "slo_ms" and "patched-slo" in refused.value.message
    assert params.to_requests("a", FAKE_INFO, 0.0)[0].slo_ms == 500


def test_a_service_tier_reaches_the_image_requests_with_its_deadline():
    """auto (or absent) is default; a tier's --tier-slo-ms is the deadline of its requests that
    send no slo_ms of their own."""
    info = dataclasses.replace(FAKE_INFO, tier_slo_ms=(("priority", 2000.0),))
    for body, tier, slo in (({}, "default", None), ({"service_tier": "auto"}, "default", None),
                            ({"service_tier": "priority"}, "priority", 2000.0),
                            ({"service_tier": "priority", "slo_ms": 500}, "priority", 500.0),
                            ({"service_tier": "flex"}, "flex", None)):
        params = ImageGenerationRequest.model_validate({"prompt": "p", **body}, context=CONTEXT)
        [request] = params.to_requests("a", info, 0.0)
        assert (request.tier.label, request.slo_ms) == (tier, slo), body


def test_block_cache_is_refused_where_every_step_runs_sequence_parallel():
    params = ImageGenerationRequest.model_validate({"prompt": "p", "block_cache": 0.1}, context=CONTEXT)
    with pytest.raises(InvalidRequestError) as refused:
        params.to_requests("a", dataclasses.replace(FAKE_INFO, unserved=tuple(unserved({}, "--policy x").items())), 0.0)
    assert refused.value.param == "block_cache" and "several devices" in refused.value.message
    assert params.to_requests("a", FAKE_INFO, 0.0)[0].block_cache == 0.1
    exact = ImageGenerationRequest.model_validate({"prompt": "p", "block_cache": 0}, context=CONTEXT)
    parallel = dataclasses.replace(FAKE_INFO, unserved=tuple(unserved({}, "--policy x").items()))
    assert exact.to_requests("a", parallel, 0.0)[0].block_cache == 0


def test_a_negative_prompt_with_guidance_reaches_the_image_requests():
    params = ImageGenerationRequest.model_validate({"prompt": "p", "negative_prompt": "blurry"}, context=CONTEXT)
    assert params.to_requests("a", FAKE_INFO, 0.0)[0].negative_prompt == "blurry"


def test_partial_images_need_stream():
    assert "needs stream=true" in _json_error('{"prompt": "p", "partial_images": 2}').message
    streamed = ImageGenerationRequest.model_validate({"prompt": "p", "partial_images": 2, "stream": True},
                                                     context=CONTEXT)
    assert streamed.to_requests("a", FAKE_INFO, 0.0)[0].partial_images == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [('"background": "transparent"', "background"), ('"output_compression": 50', "output_compression"),
     ('"stream": true, "response_format": "url"', "response_format")],
)  # fmt: skip
def test_values_gouache_cannot_honour_are_refused(body: str, param: str):
    assert _json_error(f'{{"prompt": "p", {body}}}').param == param


def test_output_compression_reaches_the_image_requests():
    params = ImageGenerationRequest.model_validate({"prompt": "p", "output_format": "webp",
                                                    "output_compression": 30}, context=CONTEXT)
    assert params.to_requests("a", FAKE_INFO, 0.0)[0].output_compression == 30


def test_edit_size_auto_is_the_upload_size():
    params = ImageEditRequest.model_validate({"prompt": "p"}, context=CONTEXT)
    assert params.size == "auto" and params.at_upload_size(96, 64, LIMITS).width_height == (96, 64)
    with pytest.raises(InvalidRequestError) as refused:
        params.at_upload_size(100, 64, LIMITS)
    assert (refused.value.param == "size" and "100x64" in refused.value.message
            and "multiples of 16" in refused.value.message)
    sized = ImageEditRequest.model_validate({"prompt": "p", "size": "128x64"}, context=CONTEXT)
    assert sized.width_height == (128, 64)


def test_file_store_expires_files():
    now = [0.0]
    store = FileStore(ttl_s=10, clock=lambda: now[0])
    file_id = store.put(b"png", "image/png")
    assert store.get(file_id).data == b"png"
    now[0] = 10.5
    assert store.get(file_id) is None and len(store) == 0


def test_file_store_evicts_oldest_beyond_max_bytes():
    store = FileStore(ttl_s=10, max_bytes=10)
    first, second = store.put(b"123456", "image/png"), store.put(b"123456", "image/png")
    assert store.get(first) is None and store.get(second) is not None
