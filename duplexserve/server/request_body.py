"""Request bodies of the HTTP API: bounded as they arrive, and their JSON bounded in depth.

Starlette's ``Request.body()`` keeps a whole body before anyone can look at its size, and a
chunked body has no ``Content-Length`` to check first: 250 MB sent that way cost the server
about 600 MB. :func:`read_body` stops at the limit instead. JSON nested thousands deep makes
``json.loads`` raise RecursionError, and a little less deep makes whatever walks it later
do so; :func:`parse_json` refuses both as a ValueError that says so.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from duplexserve.server.core.budgets import over_budget

#: The most bytes a body of the HTTP API may have (an SDP offer with its session: a few KiB).
MAX_BODY_BYTES = 64 << 10
#: The deepest JSON accepted in a body (a session config nests four or five levels).
MAX_JSON_DEPTH = 32


class BodyTooLarge(ValueError):
    """The body passed :data:`MAX_BODY_BYTES`: answer 413 and close the connection, so the
    rest of it is never read."""


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body, or BodyTooLarge as soon as its declared or received size passes ``limit``."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        over_budget("request_body")
        raise BodyTooLarge(f"the body is over {limit} bytes")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            over_budget("request_body")
            raise BodyTooLarge(f"the body is over {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


def parse_json(data: str | bytes, what: str) -> Any:
    """``data`` as JSON, or ValueError naming ``what`` when it is not JSON or nests too deep."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack
        raise ValueError(f"{what} is not JSON") from None
    level: list[Any] = [value]
    for _ in range(MAX_JSON_DEPTH):
        level = [
            child for item in level if isinstance(item, (dict, list))
            for child in (item.values() if isinstance(item, dict) else item)
        ]  # fmt: skip
        if not level:
            return value
    if any(isinstance(item, (dict, list)) and item for item in level):
        raise ValueError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    return value
