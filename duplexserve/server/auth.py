"""API keys and browser origins, checked before a session is opened.

A key may come as ``Authorization: Bearer <key>``, as ``?token=<key>`` (for clients
that cannot set headers), or as a ``openai-insecure-api-key.<key>`` WebSocket
subprotocol (what browser OpenAI Realtime clients send). Keys are compared in
constant time and never logged (server/log_redaction.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any
from urllib.parse import SplitResult, urlsplit

SUBPROTOCOL_KEY_PREFIX = "openai-insecure-api-key."


def parse_list(raw: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def _headers(scope: dict[str, Any]) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def subprotocols(scope: dict[str, Any]) -> list[str]:
    return list(scope.get("subprotocols") or [])


def presented_keys(scope: dict[str, Any], query: dict[str, str]) -> list[str]:
    keys = []
    auth = _headers(scope).get("authorization", "")
    if auth[:7].lower() == "bearer ":
        keys.append(auth[7:].strip())
    if "token" in query:
        keys.append(query["token"])
    prefix = SUBPROTOCOL_KEY_PREFIX
    keys.extend(p[len(prefix) :] for p in subprotocols(scope) if p.startswith(prefix))
    return keys


def key_ok(scope: dict[str, Any], query: dict[str, str], allowed: Iterable[str]) -> bool:
    allowed = tuple(allowed)
    if not allowed:
        return True
    found = False
    for key in presented_keys(scope, query):
        for good in allowed:  # every comparison runs: no early exit to time
            found |= hmac.compare_digest(key.encode(), good.encode())
    return found


def origin_ok(scope: dict[str, Any], allowed: Iterable[str]) -> bool:
    """Whether the page that sent this request may: browsers always send Origin, other
    clients usually do not and are let through. A page of this server's own origin (the
    talk page) always may, others only when ``--allowed-origins`` names them (or ``*``):
    without this, any web page a user opens could drive the server from their browser."""
    headers = _headers(scope)
    origin = headers.get("origin")
    if origin is None:
        return True
    allowed = tuple(allowed)
    if origin in allowed or "*" in allowed:
        return True
    try:
        host = urlsplit("//" + headers.get("host", ""))
        return _same_origin(urlsplit(origin), host, scope.get("scheme", "http"))
    except ValueError:  # not a URL (an unclosed IPv6 bracket, say), or a port out of range
        return False


#: The port a URL of each scheme means when it names none.
DEFAULT_PORTS = {"http": 80, "https": 443}


def _same_origin(page: SplitResult, host: SplitResult, scheme: str) -> bool:
    """The page's origin is the server's: the same host name as the Host header; the same
    port where the Host header names one (a proxy may pass the host without its port, as
    nginx's ``$host`` does: then any); and no plain-HTTP page for a request that came over
    TLS (an ``https`` page over plain HTTP is a proxy ending TLS in front)."""
    if page.hostname is None or page.hostname != host.hostname:
        return False
    if scheme in ("https", "wss") and page.scheme != "https":
        return False
    return host.port is None or (page.port or DEFAULT_PORTS.get(page.scheme)) == host.port
