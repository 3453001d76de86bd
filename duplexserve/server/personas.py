"""``GET /v1/voices``: the voice prompts a session may name (PersonaPlex).

What every protocol shares about a session's prompt is in core/prompts.py; how long
sessions took to be ready, and their prompts by outcome, in core/readiness.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from duplexserve.config import ServerConfig
from duplexserve.server import auth
from duplexserve.server.http_errors import http_error

if TYPE_CHECKING:
    from duplexserve.server.core.orchestrator import Orchestrator


def voices_route(config: ServerConfig, orch: Orchestrator) -> Callable[[Request], Awaitable[Response]]:
    """``GET /v1/voices``: the voice prompts of the engine (an empty list for a model without
    prompts), in OpenAI's list shape; the key and Origin checked as for the WebSockets."""

    async def voices(request: Request) -> Response:
        if not auth.origin_allowed(request.scope, auth.parse_list(config.allowed_origins)):
            return http_error(403, "origin_not_allowed", "this Origin may not connect")
        if not auth.key_ok(request.scope, dict(request.query_params), auth.parse_list(config.api_keys)):
            return http_error(401, "invalid_api_key", "a valid API key is required")
        data = [{"id": name, "object": "voice"} for name in orch.engine.voices]
        return JSONResponse({"object": "list", "data": data})

    return voices
