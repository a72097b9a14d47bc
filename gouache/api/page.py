"""GET /: the playground and status page. Plain HTML, CSS and JavaScript modules shipped in the
package (`gouache/api/ui`, served under /ui/): no build step, nothing fetched from elsewhere. The
page uses the public API like any client; it is open without the API key (it holds no data) and
asks its user for the key when the server wants one."""

from __future__ import annotations

import functools
from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response
from starlette.types import Scope

from gouache.api.context import ApiContext, get_context

UI_DIR = Path(__file__).parent / "ui"
_KEY_MARK = 'data-api-key="optional"'  # index.html's <body> attribute; "required" when --api-key is set

router = APIRouter()


class _UiFiles(StaticFiles):
    """The page's files, revalidated on every load (their ETag makes that cheap), so a browser
    never pairs a new index.html with old modules after an upgrade."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers["Cache-Control"] = "no-cache"
        return response


def static_files() -> StaticFiles:
    """What the app mounts at /ui."""
    return _UiFiles(directory=UI_DIR)


@functools.cache
def _page() -> str:
    return (UI_DIR / "index.html").read_text()


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def playground(ctx: ApiContext = Depends(get_context)) -> HTMLResponse:
    page = _page()
    if ctx.config.api_key is not None:
        page = page.replace(_KEY_MARK, 'data-api-key="required"')
    return HTMLResponse(page, headers={"Cache-Control": "no-cache"})
