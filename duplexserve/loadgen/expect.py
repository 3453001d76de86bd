"""``--expect auto``: what the server's answers are checked against, asked of the server.

Only the synthetic echo engine answers byte for byte what it was sent; a real model's
answers cannot be predicted, and checking them as an echo fails every session
(``frames ... altered``). ``GET /ready`` names the engine a duplexserve server runs; the
bench's echo floors answer it without one, being echoes themselves.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from urllib.parse import urlsplit, urlunsplit


def ready_url(ws_url: str) -> str:
    """``ws://host:port/any`` -> ``http://host:port/ready``."""
    parts = urlsplit(ws_url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, "/ready", "", ""))


def server_expect(ws_url: str, timeout: float = 10.0) -> tuple[str, str]:
    """What ``--expect auto`` means for the server at ``ws_url``, and why, in words."""
    try:
        with urllib.request.urlopen(ready_url(ws_url), timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:  # 503: full or draining, the body still says the engine
        body = exc.read()
    except OSError as exc:
        return "none", f"/ready did not answer ({exc}): answers not checked"
    try:
        ready = json.loads(body)
    except ValueError:
        return "none", "/ready is not JSON: answers not checked"
    engine = ready.get("engine") if isinstance(ready, dict) else None
    if engine in (None, "synthetic"):
        what = "an echo" if engine is None else "the synthetic echo engine"
        return "echo", f"the server runs {what}: every answer checked byte for byte"
    return "none", f"the server runs the {engine} engine: answers counted and timed, not checked"
