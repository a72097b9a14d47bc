"""Malformed requests the API must answer with a 4xx JSON error, reusable against any server.

Each case is sent with `client.request(case.method, case.path, **case.request_kwargs())` on an
httpx client (sync or async) whose base URL is the server. Cases that depend on limits are built
from a ServerConfig and the model's size step, so the same corpus works against the real engine:

    for case in malformed_requests(config, size_step=engine.info.size_step): ...
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from gouache.config import ServerConfig

GENERATIONS = "/v1/images/generations"
EDITS = "/v1/images/edits"
_NO_BODY = object()


def png(width: int = 64, height: int = 64, mode: str = "RGBA") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (width, height)).save(buffer, "PNG")
    return buffer.getvalue()


@dataclass(frozen=True)
class Malformed:
    name: str  # what is wrong, also the pytest id
    method: str
    path: str
    status: int  # expected HTTP status
    param: str | None = None  # the field the error must name; None if no field is to blame
    body: Any = _NO_BODY  # sent as JSON with Content-Type application/json
    content: bytes | None = None  # sent raw (with `headers`)
    headers: dict[str, str] = field(default_factory=dict)
    data: dict[str, str] | None = None  # multipart text fields
    files: list[tuple[str, tuple[str, bytes, str]]] | None = None  # multipart files

    def request_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"headers": dict(self.headers)}
        if self.body is not _NO_BODY:
            kwargs["content"] = json.dumps(self.body).encode()
            kwargs["headers"].setdefault("content-type", "application/json")
        if self.content is not None:
            kwargs["content"] = self.content
        if self.files is not None:
            kwargs["files"] = self.files
        if self.data is not None:
            kwargs["data"] = self.data
        return kwargs


def _gen(name: str, param: str | None, status: int = 400, **fields: Any) -> Malformed:
    return Malformed(name, "POST", GENERATIONS, status, param, body={"prompt": "a red fox", **fields})


def _edit(name: str, param: str | None, data: dict[str, str], files: list, status: int = 400) -> Malformed:
    return Malformed(name, "POST", EDITS, status, param, data=data, files=files)


def _generation_cases(config: ServerConfig, size_step: int) -> list[Malformed]:
    off_step = 100 if 100 % size_step else config.min_size + 1
    too_big = config.max_size + size_step
    return [
        Malformed("bad json", "POST", GENERATIONS, 400, content=b'{"prompt": ',
                  headers={"content-type": "application/json"}),
        Malformed("empty body", "POST", GENERATIONS, 400, content=b"", headers={"content-type": "application/json"}),
        Malformed("json array", "POST", GENERATIONS, 400, body=[{"prompt": "x"}]),
        Malformed("json string", "POST", GENERATIONS, 400, body="a red fox"),
        Malformed("text/plain", "POST", GENERATIONS, 400, content=b'{"prompt": "x"}',
                  headers={"content-type": "text/plain"}),
        Malformed("form urlencoded", "POST", GENERATIONS, 400, data={"prompt": "x"}),
        Malformed("missing prompt", "POST", GENERATIONS, 400, "prompt", body={"n": 1}),
        _gen("empty prompt", "prompt", prompt=""),
        _gen("strength on a generation", "strength", strength=0.5),
        _gen("blank prompt", "prompt", prompt="   "),
        _gen("prompt int", "prompt", prompt=5),
        _gen("prompt list", "prompt", prompt=["a", "b"]),
        _gen("huge prompt", "prompt", prompt="x" * 40_000),
        _gen("n=0", "n", n=0),
        _gen("n too large", "n", n=config.max_n + 1),
        _gen("n=11", "n", n=11),
        _gen("n string", "n", n="two"),
        _gen("n numeric string", "n", n="2"),
        _gen("n float", "n", n=1.5),
        _gen("n bool", "n", n=True),
        _gen("size abc", "size", size="abc"),
        _gen("size off step", "size", size=f"{off_step}x{off_step}"),
        _gen("size too large", "size", size=f"{too_big}x{too_big}"),
        _gen("size too small", "size", size=f"{size_step}x{size_step}"),
        _gen("size negative", "size", size="-512x512"),
        _gen("size int", "size", size=512),
        _gen("size three parts", "size", size="512x512x3"),
        _gen("steps 0", "num_inference_steps", num_inference_steps=0),
        _gen("steps too many", "num_inference_steps", num_inference_steps=config.max_steps + 799),
        _gen("steps float", "num_inference_steps", num_inference_steps=2.5),
        _gen("guidance -1", "guidance_scale", guidance_scale=-1),
        _gen("guidance huge", "guidance_scale", guidance_scale=1000),
        _gen("guidance string", "guidance_scale", guidance_scale="high"),
        _gen("seed -1", "seed", seed=-1),
        _gen("seed too big", "seed", seed=2**70),
        _gen("seed string", "seed", seed="abc"),
        _gen("slo 0", "slo_ms", slo_ms=0),
        _gen("service_tier unknown", "service_tier", service_tier="gold"),
        _gen("service_tier number", "service_tier", service_tier=1),
        _gen("block_cache -0.1", "block_cache", block_cache=-0.1),
        _gen("block_cache 1.5", "block_cache", block_cache=1.5),
        _gen("loras not a list", "loras", loras="ink"),
        _gen("loras name with a path", "loras.0.name", loras=[{"name": "../ink"}]),
        _gen("loras scale huge", "loras.0.scale", loras=[{"name": "ink", "scale": 100}]),
        _gen("loras name twice", "loras", loras=[{"name": "ink"}, {"name": "ink", "scale": 0.5}]),
        _gen("loras unknown field", "loras.0.weight", loras=[{"name": "ink", "weight": 1}]),
        _gen("loras too many", "loras", loras=[{"name": f"ink{i}"} for i in range(9)]),
        _gen("controlnets not a list", "controlnets", controlnets="edges"),
        _gen("controlnets name with a path", "controlnets.0.name", controlnets=[{"name": "../e", "image": "aGk="}]),
        _gen("controlnets image not base64", "controlnets.0", controlnets=[{"name": "edges", "image": "%%"}]),
        _gen("controlnets scale negative", "controlnets.0.scale",
             controlnets=[{"name": "edges", "image": "aGk=", "scale": -1}]),
        _gen("controlnets too many", "controlnets", controlnets=[{"name": "edges", "image": "aGk="}] * 5),
        _gen("controlnet_mode without controlnets", "controlnet_mode", controlnet_mode="async"),
        _gen("unknown model", "model", status=404, model="no-such-model"),
        _gen("model int", "model", model=3),
        _gen("bad response_format", "response_format", response_format="jpeg"),
        _gen("bad output_format", "output_format", output_format="gif"),
        _gen("partial_images 4", "partial_images", partial_images=4),
        _gen("stream string", "stream", stream="yes"),
        _gen("bad quality", "quality", quality="ultra"),
        _gen("bad style", "style", style="cubist"),
        _gen("output_compression 101", "output_compression", output_compression=101),
        _gen("output_compression with png", "output_compression", output_compression=80),
        _gen("background transparent", "background", background="transparent"),
        _gen("partial_images without stream", "partial_images", partial_images=2),
        _gen("url with stream", "response_format", stream=True, response_format="url"),
        _gen("negative_prompt int", "negative_prompt", negative_prompt=5),
        _gen("unknown field", "foo", foo=1),
        Malformed("huge body", "POST", GENERATIONS, 413, content=b" " * (config.max_body_bytes + 1),
                  headers={"content-type": "application/json"}),
    ]  # fmt: skip


def _edit_cases(config: ServerConfig, size_step: int) -> list[Malformed]:
    image = ("image", ("in.png", png(), "image/png"))
    mask = ("mask", ("m.png", png(), "image/png"))
    off_step = 100 if 100 % size_step else config.min_size + 1
    too_small = config.min_size // 2
    text = {"prompt": "paint it blue"}
    return [
        _edit("edit missing image", "image", text, [("mask", ("m.png", png(), "image/png"))]),
        _edit("edit empty image", "image", text, [("image", ("in.png", b"", "image/png"))]),
        _edit("edit image as text", "image", {**text, "image": "not a file"},
              [("mask", ("m.png", png(), "image/png"))]),
        _edit("edit non-image upload", "image", text, [("image", ("in.png", b"hello, world", "image/png"))]),
        _edit("edit non-image mask", "mask", text, [image, ("mask", ("m.png", b"GIF89a?", "image/png"))]),
        _edit("edit template_id with a slash", "template_id", {**text, "template_id": "../x"}, [image, mask]),
        _edit("edit template_id refused by template_cache", "template_id",
              {**text, "template_id": "shirt", "template_cache": "false"}, [image, mask]),
        _edit("edit loras not JSON", "loras", {**text, "loras": '[{"name": '}, [image, mask]),
        _edit("edit controlnets not JSON", "controlnets", {**text, "controlnets": "edges"}, [image, mask]),
        _edit("edit template_cache not a boolean", "template_cache", {**text, "template_cache": "maybe"},
              [image, mask]),
        _edit("edit mask size mismatch", "mask", text, [image, ("mask", ("m.png", png(32, 32), "image/png"))]),
        _edit("edit two images", "image", text, [image, image]),
        _edit("edit image and image[]", "image", text, [image, ("image[]", ("b.png", png(), "image/png"))]),
        _edit("edit two masks", "mask", text, [image, mask, mask]),
        _edit("edit upload off step, no size", "size", text,
              [("image", ("in.png", png(off_step, off_step), "image/png"))]),
        _edit("edit upload too small, size auto", "size", {**text, "size": "auto"},
              [("image", ("in.png", png(too_small, too_small), "image/png"))]),
        _edit("edit non-image upload, size given", "image", {**text, "size": "64x64"},
              [("image", ("in.png", b"hello, world", "image/png"))]),
        _edit("edit partial_images without stream", "partial_images", {**text, "partial_images": "1"}, [image]),
        _edit("edit strength 0", "strength", {**text, "strength": "0"}, [image]),
        _edit("edit strength above 1", "strength", {**text, "strength": "1.5"}, [image]),
        _edit("edit strength nan", "strength", {**text, "strength": "nan"}, [image]),
        _edit("edit strength abc", "strength", {**text, "strength": "abc"}, [image]),
        _edit("edit strength with a mask", "strength", {**text, "strength": "0.5"}, [image, mask]),
        _edit("edit strength with template_cache", "strength", {**text, "strength": "0.5", "template_cache": "true"},
              [image]),
        _edit("edit missing prompt", "prompt", {"n": "1"}, [image]),
        _edit("edit empty prompt", "prompt", {"prompt": ""}, [image]),
        _edit("edit n abc", "n", {**text, "n": "abc"}, [image]),
        _edit("edit n 0", "n", {**text, "n": "0"}, [image]),
        _edit("edit size abc", "size", {**text, "size": "abc"}, [image]),
        _edit("edit steps 0", "num_inference_steps", {**text, "num_inference_steps": "0"}, [image]),
        _edit("edit guidance nan", "guidance_scale", {**text, "guidance_scale": "nan"}, [image]),
        _edit("edit unknown model", "model", {**text, "model": "no-such-model"}, [image], status=404),
        _edit("edit style (generation only)", "style", {**text, "style": "vivid"}, [image]),
        _edit("edit prompt as file", "prompt", {}, [image, ("prompt", ("p.txt", b"hi", "text/plain"))]),
        Malformed("edit as json", "POST", EDITS, 400, body={"prompt": "x", "image": "aGVsbG8="}),
        Malformed("edit bad multipart", "POST", EDITS, 400, content=b"--xyz\r\ngarbage",
                  headers={"content-type": "multipart/form-data; boundary=xyz"}),
    ]  # fmt: skip


def _route_cases() -> list[Malformed]:
    return [
        Malformed("GET on POST route", "GET", GENERATIONS, 405),
        Malformed("PUT on POST route", "PUT", EDITS, 405),
        Malformed("unknown route", "GET", "/v1/nothing-here", 404),
        Malformed("variations unsupported", "POST", "/v1/images/variations", 404),
        Malformed("delete unknown request", "DELETE", "/v1/images/requests/img_nope", 404, "request_id"),
        Malformed("unknown file", "GET", "/v1/files/file-nope", 404, "file_id"),
        Malformed("unknown model card", "GET", "/v1/models/no-such-model", 404, "model"),
    ]


def malformed_requests(config: ServerConfig | None = None, size_step: int = 8) -> list[Malformed]:
    config = config or ServerConfig()
    return _generation_cases(config, size_step) + _edit_cases(config, size_step) + _route_cases()


MALFORMED_REQUESTS = malformed_requests()  # for the default ServerConfig and a size step of 8
