"""Every error leaves the server as OpenAI's JSON shape: {"error": {message, type, param, code}}.

GouacheErrors keep their status; pydantic errors become 400 naming the field; unknown routes 404,
wrong methods 405; anything unexpected 500 with a generic message (the traceback is logged, never
sent). Each error response is counted in `errors_total{kind}`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from gouache.errors import GouacheError, InvalidRequestError

if TYPE_CHECKING:
    from gouache.metrics import Metrics

logger = logging.getLogger(__name__)

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}
_LOCATIONS = ("body", "query", "path", "header")  # FastAPI's first loc item, not a field name


class NotFoundError(InvalidRequestError):
    """A file or request id that does not exist (or no longer does)."""

    kind = "not_found"
    status = 404


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(message: str, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_headers(error: GouacheError, request_id: str | None = None) -> dict[str, str]:
    headers = {"x-request-id": request_id} if request_id else {}
    retry_after = getattr(error, "retry_after_s", None)
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(retry_after)))
    return headers


def error_response(error: GouacheError, request_id: str | None = None) -> JSONResponse:
    body = error_body(error.message, error.status, error.kind, error.param)
    return JSONResponse(body, status_code=error.status, headers=error_headers(error, request_id))


def from_validation_errors(errors: list[Any]) -> InvalidRequestError:
    """The first pydantic error as a 400 whose message and `param` name the field."""
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ())]
    if loc and loc[0] in _LOCATIONS:
        loc = loc[1:]
    param = ".".join(loc) or None
    kind, reason = first.get("type", ""), str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "json_invalid":
        return InvalidRequestError(f"The request body is not valid JSON: {reason.removeprefix('Invalid JSON: ')}.")
    if param is None:
        return InvalidRequestError(f"Invalid request body: {reason}.")
    if kind == "missing":
        return InvalidRequestError(f"Missing required parameter: '{param}'.", param)
    if kind == "extra_forbidden":
        return InvalidRequestError(f"Unknown parameter: '{param}'.", param)
    return InvalidRequestError(f"Invalid value for '{param}': {reason} (got {_short(first.get('input'))}).", param)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _from_http_exception(request: Request, exc: HTTPException) -> GouacheError:
    if exc.status_code == 404:
        message = f"Unknown route: {request.method} {request.url.path}."
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
    else:
        message = str(exc.detail)
    error = GouacheError(message)  # instance attributes shadow the class's, as in RequestHandle.images()
    error.status, error.kind = exc.status_code, _HTTP_CODES.get(exc.status_code, "invalid_request")
    return error


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Route every exception a request can raise to an OpenAI-shaped JSON response."""

    def respond(request: Request, error: GouacheError, headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.errors.labels(error.kind).inc()
        response = error_response(error, getattr(request.state, "request_id", None))
        response.headers.update(headers or {})
        return response

    async def on_gouache_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, GouacheError)
        return respond(request, exc)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ValidationError | RequestValidationError)
        return respond(request, from_validation_errors(list(exc.errors())))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return respond(request, _from_http_exception(request, exc), exc.headers)

    async def on_disconnect(request: Request, exc: Exception) -> Response:
        # the client left before its body arrived (a cancel mid-upload): nothing was accepted,
        # and nobody reads the answer (499: nginx's "client closed request")
        logger.info("a client left before sending its whole %s %s", request.method, request.url.path)
        return Response(status_code=499)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return respond(request, GouacheError("The server had an error while processing your request."))

    app.add_exception_handler(GouacheError, on_gouache_error)
    app.add_exception_handler(ValidationError, on_validation_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(ClientDisconnect, on_disconnect)
    app.add_exception_handler(Exception, on_unexpected)
