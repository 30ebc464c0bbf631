"""Authenticated admin API for forward passes, mounted on the engine server's app.

    POST /admin/forward-passes           JSON {"path": "/bundles/x" | "/x.tar.gz", "expectedDigest": "..."}
                                         or a .tar.gz body (Content-Type application/gzip or
                                         application/octet-stream; optional X-Bundle-Digest header)
    GET  /admin/forward-passes           {"active": {...}, "history": [...]} (+ "rollout": the rollout
                                         agent's status when the server follows pod annotations)
    POST /admin/forward-passes/rollback  JSON {"steps": 1} (optional)

Data flow of a load: request -> bearer token checked (constant time) -> bundle written to
a private temp file (uploads) -> ``ForwardPassManager.prepare`` in a worker thread (verify
sha256s, import in isolation, build over the loaded weights, smoke, CUDA-graph capture)
while the engine keeps serving -> ``AsyncEngine.call`` runs ``commit`` on the engine thread
between two steps -> 200 with timings. A refused candidate answers 422 with the stage that
refused it (open, import, build, smoke) and the old pass keeps serving.

The token comes from a file (a mounted Kubernetes Secret; re-read on every call so a
rotated Secret takes effect) or an environment variable. Missing or wrong tokens get 401.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import tempfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from shapeshift.engine.forward_pass.bundle import MAX_BUNDLE_BYTES
from shapeshift.engine.forward_pass.importer import ReloadError
from shapeshift.engine.forward_pass.swap import ForwardPassManager

TOKEN_ENV = "SHAPESHIFT_ADMIN_TOKEN"
TOKEN_FILE_ENV = "SHAPESHIFT_ADMIN_TOKEN_FILE"


class AdminTokenSource:
    """Where the admin token lives: a file (re-read each time) or an environment variable."""

    def __init__(self, token_file: str | Path | None = None, token_env: str = TOKEN_ENV) -> None:
        self.token_file = Path(token_file) if token_file else (
            Path(os.environ[TOKEN_FILE_ENV]) if os.environ.get(TOKEN_FILE_ENV) else None)
        self.token_env = token_env
        if self.current() is None:
            where = f"file {self.token_file}" if self.token_file else f"${token_env} or ${TOKEN_FILE_ENV}"
            raise ValueError(f"no admin token found in {where}; mount the admin Secret or set the variable "
                             "(an admin API without a token would accept anyone)")

    def current(self) -> str | None:
        if self.token_file is not None:
            try:
                token = self.token_file.read_text().strip()
            except OSError:
                return None
        else:
            token = (os.environ.get(self.token_env) or "").strip()
        return token or None


def _unauthorized(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "authentication_error", "code": "401"}},
                        status_code=401, headers={"WWW-Authenticate": "Bearer"})


class _Unauthorized(Exception):
    pass


def mount_admin(app: FastAPI, engine_handle: Any, token_file: str | Path | None = None, *,
                token_env: str = TOKEN_ENV, manager: ForwardPassManager | None = None) -> ForwardPassManager:
    """Add the /admin/forward-passes routes to ``app``; returns the manager they drive.

    ``engine_handle``: the server's AsyncEngine (swaps run on its engine thread between
    steps) or a bare LLMEngine (swaps run inline; only for single-threaded use).
    """
    tokens = AdminTokenSource(token_file, token_env)
    engine = getattr(engine_handle, "engine", engine_handle)
    manager = manager or ForwardPassManager(engine)
    app.state.forward_pass_manager = manager

    async def on_engine_thread(fn: Any) -> Any:
        if hasattr(engine_handle, "call"):
            return await engine_handle.call(lambda _engine: fn())
        return fn()

    async def require_token(request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        expected = tokens.current()
        if expected is None or scheme.lower() != "bearer" or not given:
            raise _Unauthorized("admin API needs 'Authorization: Bearer <token>'")
        if not hmac.compare_digest(given.strip().encode(), expected.encode()):
            raise _Unauthorized("admin token is not valid")

    @app.exception_handler(_Unauthorized)
    async def _unauth(request: Request, exc: _Unauthorized) -> JSONResponse:
        return _unauthorized(str(exc))

    router = APIRouter(prefix="/admin", dependencies=[Depends(require_token)])

    def refused(exc: ReloadError) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc), "type": "forward_pass_refused", "stage": exc.stage},
                             "active": manager.active.summary()}, status_code=422)

    @router.get("/forward-passes")
    async def list_passes(request: Request) -> dict[str, Any]:
        listing = manager.listing()
        agent = getattr(request.app.state, "rollout_agent", None)
        if agent is not None:  # the pod-annotation rollout this server follows
            listing["rollout"] = agent.status()
        return listing

    @router.post("/forward-passes")
    async def load_pass(request: Request) -> JSONResponse:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        tmp_path: Path | None = None
        try:
            if content_type in ("application/gzip", "application/x-gzip", "application/octet-stream",
                                "application/x-tar"):
                body = await request.body()
                if len(body) > MAX_BUNDLE_BYTES:
                    return JSONResponse({"error": {"message": f"archive larger than {MAX_BUNDLE_BYTES} bytes",
                                                   "type": "invalid_request_error"}}, status_code=413)
                fd, name = tempfile.mkstemp(prefix="shapeshift-upload-", suffix=".tar.gz")
                with os.fdopen(fd, "wb") as f:
                    f.write(body)
                tmp_path = Path(name)
                path, expected = tmp_path, request.headers.get("x-bundle-digest")
            else:
                try:
                    data = await request.json()
                except Exception:
                    data = None
                if not isinstance(data, dict) or not isinstance(data.get("path"), str):
                    return JSONResponse({"error": {"message": "body must be JSON {\"path\": \"<bundle folder or "
                                                              ".tar.gz>\"} or a .tar.gz upload",
                                                   "type": "invalid_request_error", "param": "path"}},
                                        status_code=400)
                path, expected = Path(data["path"]), data.get("expectedDigest")
            try:
                prepared = await asyncio.to_thread(manager.prepare, path, expected)
                result = await on_engine_thread(lambda: manager.commit(prepared))
            except ReloadError as exc:
                return refused(exc)
            body = result.to_dict()
            if tmp_path is not None:
                body["source"] = "upload"
            return JSONResponse(body)
        finally:
            if tmp_path is not None:
                tmp_path.unlink(missing_ok=True)

    @router.post("/forward-passes/rollback")
    async def rollback(request: Request) -> JSONResponse:
        steps = 1
        raw = await request.body()
        if raw.strip():
            try:
                data = await request.json()
                steps = int(data.get("steps", 1))
            except Exception:
                return JSONResponse({"error": {"message": "body must be JSON {\"steps\": <int>}",
                                               "type": "invalid_request_error", "param": "steps"}}, status_code=400)
        try:
            result = await on_engine_thread(lambda: manager.rollback(steps))
        except ReloadError as exc:
            return refused(exc)
        return JSONResponse(result.to_dict())

    app.include_router(router)
    return manager
