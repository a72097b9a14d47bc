"""Errors that end a request. Each carries the HTTP status the API answers with.

Kept free of torch and FastAPI so that every layer (engine, scheduler, API) can raise and
catch them.
"""

from __future__ import annotations


class GouacheError(Exception):
    """Base class: a request ended with an explicit error instead of images."""

    kind = "server_error"  # machine-readable code, also the `errors_total{kind=...}` label
    status = 500  # HTTP status the API answers with

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param  # the request field to fix, if one is to blame


class InvalidRequestError(GouacheError):
    """The request itself is wrong; `param` names the field."""

    kind = "invalid_request"
    status = 400


class UnknownModelError(InvalidRequestError):
    kind = "model_not_found"
    status = 404


class PayloadTooLargeError(InvalidRequestError):
    kind = "payload_too_large"
    status = 413


class QueueFullError(GouacheError):
    """The engine's queue is at its limit; the client should retry later."""

    kind = "queue_full"
    status = 429

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TenantLimitError(QueueFullError):
    """A tenant is over its request rate or its concurrency limit (`gouache.api.tenants`); the
    others are not."""

    kind = "rate_limit_exceeded"


class TierForbiddenError(InvalidRequestError):
    """The tenant's key may not use the service tier it asked for."""

    kind = "tier_not_allowed"
    status = 403


class RequestTimeoutError(GouacheError):
    kind = "timeout"
    status = 504


class DeadlineUnattainableError(GouacheError):
    """The scheduler dropped the request: it cannot meet its `slo_ms` even if started now."""

    kind = "deadline_unattainable"
    status = 503


class CancelledError(GouacheError):
    kind = "cancelled"
    status = 499


class WorkerFailureError(GouacheError):
    kind = "worker_failure"
    status = 500


class EngineStoppedError(GouacheError):
    kind = "engine_stopped"
    status = 503


class ShuttingDownError(GouacheError):
    """The server is draining before it exits: new requests are refused, late ones cancelled."""

    kind = "shutting_down"
    status = 503

    def __init__(self, message: str, retry_after_s: int = 5):
        super().__init__(message)
        self.retry_after_s = retry_after_s  # another replica (or this one, restarted) can take it by then
