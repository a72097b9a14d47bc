"""GET and POST /v1/loras and /v1/controlnets: the adapters of the server's --lora-dir
(docs/lora.md) and --controlnet-dir (docs/controlnet.md). A request names them in `loras`
and `controlnets`; registering one ahead checks it against the model and loads it where it
runs, so its first request does not wait for the read."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from gouache.adapter_names import NAME
from gouache.api.context import ApiContext, get_context

router = APIRouter()


class Registration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=f"^{NAME}$")  # <name>.safetensors in --lora-dir; <name>/ in --controlnet-dir


@router.get("/v1/loras")
async def list_loras(ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    return {"object": "list", "data": await ctx.engine.list_loras()}


@router.post("/v1/loras")
async def register_lora(body: Registration, ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    return await ctx.engine.register_lora(body.name)


@router.get("/v1/controlnets")
async def list_controlnets(ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    return {"object": "list", "data": await ctx.engine.list_controlnets()}


@router.post("/v1/controlnets")
async def register_controlnet(body: Registration, ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    return await ctx.engine.register_controlnet(body.name)
