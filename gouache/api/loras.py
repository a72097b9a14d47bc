"""GET /v1/loras and POST /v1/loras: the LoRA adapters of the server's --lora-dir
(docs/adapters.md). A request names them in `loras`; registering one ahead checks it against
the model and reads it into memory, so its first request does not wait for the file."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from gouache.adapters.directory import NAME
from gouache.api.context import ApiContext, get_context

router = APIRouter()


class LoraRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=f"^{NAME}$")  # <name>.safetensors in --lora-dir


@router.get("/v1/loras")
async def list_loras(ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    return {"object": "list", "data": await ctx.engine.list_loras()}


@router.post("/v1/loras")
async def register_lora(body: LoraRegistration, ctx: ApiContext = Depends(get_context)) -> dict[str, Any]:
    return await ctx.engine.register_lora(body.name)
