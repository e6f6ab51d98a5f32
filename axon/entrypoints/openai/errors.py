"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status
(and on Anthropic's Messages API, Anthropic's shape: ``anthropic_error``).

Handlers raise ``OpenAIError`` (or one of its named constructors); the app's exception handlers
turn it, FastAPI's validation errors and Starlette's HTTP errors into the same JSON shape.
"""

from __future__ import annotations

import logging
import uuid
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

from axon.engine.async_llm import EngineDeadError

logger = logging.getLogger("axon.entrypoints.openai")


class OpenAIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = HTTPStatus.BAD_REQUEST,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, HTTPStatus.BAD_REQUEST, param=param, code=code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, param="model", code="model_not_found"
    )


def unavailable(message: str, code: str, retry_after_s: int = 1) -> OpenAIError:
    return OpenAIError(
        message,
        HTTPStatus.SERVICE_UNAVAILABLE,
        type="server_error",
        code=code,
        headers={"Retry-After": str(retry_after_s)},
    )


def internal_error(message: str) -> OpenAIError:
    return OpenAIError(message, HTTPStatus.INTERNAL_SERVER_ERROR, type="server_error", code="internal_error")


def from_exception(e: Exception) -> OpenAIError:
    """The error a client sees for an exception no check anticipated, in a response or a stream.

    Invariant: no traceback, exception text or file path reaches a client; the log keeps them,
    under an error id that the message gives.
    """
    if isinstance(e, OpenAIError):
        return e
    error_id = uuid.uuid4().hex[:12]
    if isinstance(e, EngineDeadError):
        logger.error("error %s: the engine died while serving a request", error_id)
        error = internal_error(f"The engine died while serving this request (error id {error_id}).")
        error.code = "engine_dead"
        return error
    logger.error("error %s: unexpected error while serving a request", error_id, exc_info=e)
    return internal_error(f"Internal server error (error id {error_id}).")


# HTTP status -> Anthropic's error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_error(e: OpenAIError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(e.status, e.message), status_code=e.status, headers=e.headers)
