"""Who may call the API: the optional API key (`--api-key`) and browser origins (`--cors-allow-origin`).

Data flow: ASGI request -> CORS (outermost: a preflight is answered before the key check)
-> `ApiKeyMiddleware` (every route but OPEN_PATHS, the admin API, which checks its own token,
and preflights) -> the routes.
"""

from __future__ import annotations

import hmac
from typing import Any, Callable, Sequence

from fastapi.responses import JSONResponse

from shapeshift.engine.serving.protocol import APIError

# Paths open without --api-key's token: probes and scrapes, and the admin API (its own token).
OPEN_PATHS = ("/health", "/metrics")
OPEN_PREFIXES = ("/admin/",)


class ApiKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which would wrap the receive channel the handlers watch
    for disconnects): every HTTP route but OPEN_PATHS, the admin API and CORS preflights needs
    `Authorization: Bearer <key>`, compared in constant time."""

    def __init__(self, app: Any, expected: bytes) -> None:
        self.app = app
        self.expected = expected

    async def __call__(self, scope: dict, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS \
                or scope["path"].startswith(OPEN_PREFIXES):
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        err = APIError(401, "Missing or wrong API key: send 'Authorization: Bearer <key>' with the key the server "
                            "was started with (--api-key).", code="invalid_api_key", type="authentication_error")
        err.headers = {"WWW-Authenticate": "Bearer"}
        await JSONResponse(err.body(), status_code=401, headers=err.headers)(scope, receive, send)


def add_access_control(app: Any, api_key: str | None, cors_allow_origins: Sequence[str]) -> None:
    """Install the key check and CORS on ``app`` (either may be off)."""
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, expected=f"Bearer {api_key}".encode())
    if cors_allow_origins:
        from starlette.middleware.cors import CORSMiddleware

        # Added last, so it runs first.
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_allow_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in cors_allow_origins)
