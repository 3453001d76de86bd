"""API keys and browser origins, checked before a session is opened.

A key may come as ``Authorization: Bearer <key>``, as ``?token=<key>`` (for clients
that cannot set headers), or as a ``openai-insecure-api-key.<key>`` WebSocket
subprotocol (what browser OpenAI Realtime clients send). Keys are compared in
constant time and never logged (server/log_redaction.py).

A refused Origin is logged (:class:`OriginRefusals`): the page that was refused shows only
its close, and the usual cause, a proxy that passes the upstream's Host instead of the
browser's, is otherwise invisible.
"""

from __future__ import annotations

import collections
import hmac
import logging
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import SplitResult, urlsplit

SUBPROTOCOL_KEY_PREFIX = "openai-insecure-api-key."

log = logging.getLogger("duplexserve")


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


def origin_allowed(scope: dict[str, Any], allowed: Iterable[str]) -> bool:
    """:func:`origin_ok`, and a refusal logged (rate-limited) with the Origin, the Host and the fix."""
    if origin_ok(scope, allowed):
        return True
    headers = _headers(scope)
    origin_refusals(headers.get("origin", ""), headers.get("host", ""), scope.get("path", ""))
    return False


#: One line per Origin at most this often, with the count of its refusals since the last.
ORIGIN_LOG_EVERY_S = 10.0
#: Origins remembered at most: one cycling through made-up Origins grows nothing past it.
ORIGIN_LOG_MAX = 256
_ORIGIN_CHARS = 200  # an Origin longer than this is cut, in the table and the line


class OriginRefusals:
    """Logs refused Origins: one WARNING per Origin every :data:`ORIGIN_LOG_EVERY_S` at most.

    The table is bounded: Origins whose line is older than the interval leave it (oldest
    first), and while it is full of recent ones any further Origin is only counted, in one
    line for all of them every interval, so neither memory nor the log grows with the number
    of Origins a client makes up.
    """

    def __init__(self, every_s: float = ORIGIN_LOG_EVERY_S, most: int = ORIGIN_LOG_MAX) -> None:
        self.every_s, self.most = every_s, most
        self._last: collections.OrderedDict[str, list[float]] = collections.OrderedDict()  # [at, count]
        self._others_at, self._others = -every_s, 0  # Origins past a full table: one line for all

    def __call__(self, origin: str, host: str, path: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        origin, host = origin[:_ORIGIN_CHARS], host[:_ORIGIN_CHARS]
        entry = self._last.get(origin)
        if entry is not None and now - entry[0] < self.every_s:
            entry[1] += 1
            return
        while self._last and now - next(iter(self._last.values()))[0] >= self.every_s:
            self._last.popitem(last=False)  # logged longest ago: in the order of their lines
        if len(self._last) >= self.most:
            if now - self._others_at < self.every_s:
                self._others += 1
                return
            log.warning(
                "refused a connection to %s from a page of Origin %r (Host %r), one of more Origins than "
                "the %d logged each %.0f s (origin_not_allowed; %d more of such Origins since the last such "
                "line). To let that page in, serve with --allowed-origins ORIGIN; behind a proxy, have it "
                "forward the browser's Host (nginx: proxy_set_header Host $host;)",
                path or "/", origin, host, self.most, self.every_s, self._others,
            )  # fmt: skip
            self._others_at, self._others = now, 0
            return
        since = int(entry[1]) if entry is not None else 0
        self._last.pop(origin, None)
        self._last[origin] = [now, 0.0]
        log.warning(
            "refused a connection to %s from a page of Origin %r: neither this server's origin "
            "(the request's Host is %r) nor in --allowed-origins (origin_not_allowed; %d more since "
            "this Origin's last line). To let that page in, serve with --allowed-origins %s; behind "
            "a proxy, have it forward the browser's Host (nginx: proxy_set_header Host $host;)",
            path or "/", origin, host, since, origin or "ORIGIN",
        )  # fmt: skip


origin_refusals = OriginRefusals()
