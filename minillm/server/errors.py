"""Chapter 9: the server's errors, all answered in OpenAI's envelope.

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``, with ``type``
``"invalid_request_error"`` for a 4xx the client can fix (401 with the code
``"invalid_api_key"``), ``"not_found_error"`` for 404, and ``"server_error"`` for a 5xx. A stream
whose status line has already gone out gets the same object as a last event before ``data:
[DONE]``.

`EngineError` is what the engine side (`minillm.server.async_engine`) hands a request that
could not finish: one request's own failure (500), or a fault of the whole engine or the
server's shutdown (503: retry later, elsewhere).
"""
from __future__ import annotations

import math

from pydantic import BaseModel

__all__ = ["EngineError", "ErrorBody", "ErrorResponse", "RequestFailed", "ServiceUnavailable", "envelope",
           "finite"]


class EngineError(Exception):
    """A request the engine could not finish; ``status`` is the HTTP status it maps to."""

    status = 500
    type = "server_error"
    code: str | None = None
    param: str | None = None

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code


class RequestFailed(EngineError):
    """This request's own step raised; the other requests went on (`LLMEngine._fail`)."""

    code = "request_failed"


class ServiceUnavailable(EngineError):
    """The server cannot take or finish requests now: it is shutting down, or the engine as a
    whole failed (out of memory). Retry later."""

    status = 503
    code = "service_unavailable"


def envelope(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def finite(obj):
    """``obj`` with every non-finite float made JSON-safe: ``-inf`` (a log-probability of an
    impossible token) becomes ``-9999.0`` as in vLLM, ``inf`` ``9999.0``, ``nan`` ``None``."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return None if math.isnan(obj) else math.copysign(9999.0, obj)
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope (the schema the OpenAPI document gives every error status)."""

    error: ErrorBody
