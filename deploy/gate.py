"""What every HTTP request meets before a route (``deploy.server``): the API key, and whether the replica still
admits requests (``deploy.drain``). ``/health`` and ``/ping`` pass without either (they answer 503 themselves while
draining), and so does ``/metrics`` (a scraper holds no key: vLLM's server exempts it from ``--api-key`` too),
unless ``metrics_require_api_key`` is set; then it needs the key like every other route.

One replica runs per process, so the gate is a module-level object, set by the replica when it starts.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

from fastapi.responses import JSONResponse

from deploy.protocol import ErrorDetail, ErrorResponse

# What a refused client is told to wait before trying again (another replica, or the server restarted).
RETRY_AFTER_S = 5

# Environment variables that set the API key when the configuration does not (vLLM's name too).
API_KEY_ENV = ("SPECBATCH_API_KEY", "VLLM_API_KEY")


def env_api_key() -> str | None:
    """The API key from the environment where an application is built (``API_KEY_ENV``, in that order)."""
    return next((os.environ[name] for name in API_KEY_ENV if os.environ.get(name)), None)


def error(status: int, detail: ErrorDetail) -> JSONResponse:
    """OpenAI's error body."""
    return JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=status)


def unavailable(message: str) -> JSONResponse:
    response = error(503, ErrorDetail(message=message, type="server_error", code="service_unavailable"))
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


# Routes every client may call, key or not, draining or not.
OPEN_PATHS = frozenset({"/health", "/ping"})
METRICS_PATH = "/metrics"


class Gate:
    def __init__(self) -> None:
        self.api_key: bytes | None = None
        self.metrics_require_api_key = False
        self.draining = False
        self.in_flight = 0  # requests past the gate whose response is not yet complete

    def is_open(self, path: str) -> bool:
        """Whether ``path`` passes without the key and while draining."""
        path = path.rstrip("/")
        return path in OPEN_PATHS or (path == METRICS_PATH and not self.metrics_require_api_key)

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
    """ASGI middleware: the gate for every route but the open ones (``Gate.is_open``), and the count of requests in
    flight (a streamed response counts until its last chunk is sent)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or GATE.is_open(path):
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
