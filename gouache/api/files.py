"""`GET /v1/files/{file_id}`: the images of `response_format=url` responses, from the server's
file store (`gouache.api.file_store`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from gouache.api.context import ApiContext, get_context
from gouache.api.errors import NotFoundError

router = APIRouter()


@router.get("/v1/files/{file_id}", name="get_file")
@router.get("/v1/files/{file_id}/content", name="get_file_content")
async def get_file(file_id: str, ctx: ApiContext = Depends(get_context)) -> Response:
    stored = ctx.files.get(file_id)
    if stored is None:
        raise NotFoundError(f"No such file: '{file_id}' (unknown or expired).", "file_id")
    return Response(stored.data, media_type=stored.media_type, headers={"Cache-Control": "private, max-age=60"})
