"""Pure ASGI middleware: Bearer auth on /v1/* and a request-body size limit (413).

Pure ASGI rather than Starlette's BaseHTTPMiddleware, which would sit between a streaming
response and its client and hide disconnects.
"""

from __future__ import annotations

import hmac
from http import HTTPStatus
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from axon.entrypoints.openai.errors import OpenAIError, anthropic_error


class AuthMiddleware:
    """``Authorization: Bearer KEY`` (or Anthropic's ``x-api-key: KEY``) on every /v1 route
    (vLLM leaves /health, /metrics etc. open)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not _is_v1(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        bearer_ok = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
        if bearer_ok or hmac.compare_digest(headers.get(b"x-api-key", b""), self.expected_key):
            await self.app(scope, receive, send)
            return
        error = OpenAIError(
            "Incorrect or missing API key: pass it as 'Authorization: Bearer KEY' (or 'x-api-key: KEY').",
            HTTPStatus.UNAUTHORIZED,
            code="invalid_api_key",
        )
        answer = anthropic_error(error) if is_anthropic_path(scope["path"]) else error.response()
        await answer(scope, receive, send)


def is_anthropic_path(path: str) -> bool:
    """Anthropic's Messages API, whose errors have Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def _is_v1(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


class BodyLimitMiddleware:
    """Answers 413 to a body over ``max_bytes``. The body is read (and, if too large, drained
    and dropped) before the app runs, so that the client always gets the 413 rather than a
    connection reset halfway through its upload."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        body, too_large, disconnected = await self._read(scope, receive)
        if too_large:
            error = OpenAIError(
                f"The request body exceeds the limit of {self.max_bytes} bytes (--max-request-body-size).",
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                code="request_too_large",
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, _replay(body, disconnected, receive), send)

    async def _read(self, scope: Scope, receive: Receive) -> tuple[bytes, bool, bool]:
        declared = dict(scope["headers"]).get(b"content-length")
        too_large = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", too_large, True
            size += len(message.get("body", b""))
            too_large = too_large or size > self.max_bytes
            if not too_large:
                chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks), too_large, False


def _replay(body: bytes, disconnected: bool, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if disconnected:
            return {"type": "http.disconnect"}
        if not sent:
            sent = True
            message: dict[str, Any] = {"type": "http.request", "body": body, "more_body": False}
            return message
        return await receive()

    return replay
