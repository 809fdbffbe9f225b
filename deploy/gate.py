"""What every HTTP request meets before a route (``deploy.server``): the API key, and whether the replica still
admits requests (``deploy.drain``). ``/health`` passes without either.

One replica runs per process, so the gate is a module-level object, set by the replica when it starts.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse

from deploy.protocol import ErrorDetail, ErrorResponse

# What a refused client is told to wait before trying again (another replica, or the server restarted).
RETRY_AFTER_S = 5


def error(status: int, detail: ErrorDetail) -> JSONResponse:
    """OpenAI's error body."""
    return JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=status)


def unavailable(message: str) -> JSONResponse:
    response = error(503, ErrorDetail(message=message, type="server_error", code="service_unavailable"))
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


class Gate:
    def __init__(self) -> None:
        self.api_key: bytes | None = None
        self.draining = False
        self.in_flight = 0  # requests past the gate whose response is not yet complete

    def refusal(self, scope: dict[str, Any]) -> JSONResponse | None:
        if self.api_key is not None:
            headers = dict(scope.get("headers") or [])
            scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.api_key):
                given = "Incorrect API key provided." if scheme else "You didn't provide an API key."
                message = f"{given} Send it in an Authorization header using Bearer auth (Authorization: Bearer KEY)."
                response = error(401, ErrorDetail(message=message, type="invalid_request_error",
                                                  code="invalid_api_key"))
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
        if self.draining:
            return unavailable("the server is shutting down; retry on another replica or later")
        return None


GATE = Gate()


class GateMiddleware:
    """ASGI middleware: the gate for every route but ``/health``, and the count of requests in flight (a streamed
    response counts until its last chunk is sent)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or path.rstrip("/") == "/health":
            await self.app(scope, receive, send)
            return
        refusal = GATE.refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        GATE.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            GATE.in_flight -= 1
