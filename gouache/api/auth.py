"""ASGI middleware requiring `Authorization: Bearer <key>` on every route but /health and the
playground's files: the key of one of the server's tenants (`gouache.api.tenants`), which the
routes find as `request.state.tenant`.

/health stays open so that load balancers and process managers can probe without the key; the
playground (`/` and `/ui/...`, static files holding no data) so that a browser can load it and
ask its user for the key, which it then sends as any client does.
Keys are compared in constant time; a missing or wrong key gets 401 in OpenAI's error shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from gouache.api.errors import error_response
from gouache.errors import GouacheError

if TYPE_CHECKING:
    from gouache.api.tenants import TenantBook
    from gouache.metrics import Metrics

OPEN_PATHS = frozenset({"/health", "/"})
OPEN_PREFIX = "/ui/"


class AuthenticationError(GouacheError):
    kind = "invalid_api_key"
    status = 401


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, tenants: TenantBook, metrics: Metrics):
        self.app = app
        self.tenants = tenants
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["path"].startswith(OPEN_PREFIX):
            return await self.app(scope, receive, send)
        sent = dict(scope.get("headers", ())).get(b"authorization")
        tenant = self.tenants.authenticate(sent)
        if tenant is not None:
            scope.setdefault("state", {})["tenant"] = tenant
            return await self.app(scope, receive, send)
        message = ("Missing API key: send the header 'Authorization: Bearer YOUR_KEY'." if sent is None
                   else "Incorrect API key provided.")
        error = AuthenticationError(message)
        self.metrics.errors.labels(error.kind).inc()
        response = error_response(error)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)
