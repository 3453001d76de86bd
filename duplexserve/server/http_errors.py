"""The HTTP API's error answer, in OpenAI's shape (what its SDKs parse), for every route."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def http_error(status: int, code: str, message: str) -> JSONResponse:
    """``{"error": {type, code, message, param}}`` with ``status``: ``server_error`` from
    500 on, ``invalid_request_error`` below."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"type": kind, "code": code, "message": message, "param": None}}
    return JSONResponse(body, status_code=status)
