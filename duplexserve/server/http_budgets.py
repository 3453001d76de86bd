"""What HTTP requests may cost the loop: budgets per connection, per address and in all.

uvicorn parses every request a read holds and queues the pipelined ones without bound;
FastAPI's routing then costs the loop about 100 us each. Two keep-alive connections
pipelining ``GET /health`` 32 requests a write (17k-50k requests a second) held the loop
so that every live session's frames were hundreds of milliseconds late, seconds with the
engine in its own process (issue 67). Each request is now charged, from its head alone,
before any task or routing:

- to its connection: at most ``pipeline_depth`` requests waiting behind the one being
  answered, and ``requests_per_s`` a second (``burst_s`` seconds of it at once);
- to its address (the peer's, keyed by ``address_key``: IPv6 by ``--client-ipv6-prefix``;
  none for a proxy of ``--forwarded-allow-ips``, whose clients the proxy limits):
  ``address_requests_per_s``, across its connections;
- to the server: the overload manager's ceiling and shedding (server/overload.py), which
  answer 503 but for a reserve of probes, and 429 to a client over its fair share of the
  ceiling or of the loop (the client: the one a trusted proxy names, core/client_address.py).

Over a budget: 429 with ``Retry-After`` (or nothing, where an earlier response is still due)
and the connection closed, counted as ``duplexserve_connections_over_budget_total{budget}``
and logged at most once per budget every :data:`LOG_EVERY_S`. The head is always read first
(under the head deadline, server/run.py): a WebSocket upgrade is charged by need, to its
address's ``address_upgrades_per_s`` alone (loopback: none), so plain requests that spent
the address's HTTP budget (a neighbour behind the same NAT) never refuse it; its session has
budgets of its own (transports/websocket/budgets.py, admission). Before any of it, the connection is counted
against the connection caps (server/connection_caps.py), and closed unread past one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from duplexserve.server.connection_caps import Connections, counts_per_client
from duplexserve.server.core.budgets import over_budget
from duplexserve.server.core.client_address import ForwardedFor
from duplexserve.server.core.token_buckets import AddressBuckets, Bucket, address_key
from duplexserve.server.overload import OverloadManager

log = logging.getLogger("duplexserve")

#: One log line per budget at most this often, with the count since the last.
LOG_EVERY_S = 10.0
_TOO_MANY = (
    b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 0\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
)
_UNAVAILABLE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
)


class _Stop(Exception):
    """Raised in a parser callback of a refused connection: httptools stops at once (uvicorn
    takes it for a parser error, whose answer and log line the refusal replaces)."""


_QUIET = logging.getLogger("duplexserve.http_refused")
_QUIET.disabled = True


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Per-connection and per-address request budgets; a rate of 0: no limit."""

    requests_per_s: float = 50.0
    address_requests_per_s: float = 200.0
    pipeline_depth: int = 8
    burst_s: float = 4.0
    #: WebSocket upgrades of one address a second (``burst_s`` of it at once): a budget apart.
    address_upgrades_per_s: float = 20.0


class _RefusalLog:
    """At most one line per budget every :data:`LOG_EVERY_S`, with the count since the last."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, int]] = {}

    def __call__(self, budget: str, peer: str, now: float) -> None:
        at, count = self._last.get(budget, (-LOG_EVERY_S, 0))
        if now - at < LOG_EVERY_S:
            self._last[budget] = (at, count + 1)
            return
        self._last[budget] = (now, 0)
        log.warning(
            "connection %s over its %s budget: closed (%d more since the last such line)",
            peer,
            budget,
            count,
        )


def budgeted_http(
    base: type[HttpToolsProtocol],
    limits: HttpLimits,
    overload: OverloadManager | None,
    proxies: list[str],
    ipv6_prefix: int = 64,
    connections: Connections | None = None,
) -> type[HttpToolsProtocol]:
    """``base`` with the request budgets of ``limits``, the overload manager's shedding and
    the connection caps of ``connections``; clients keyed by ``address_key``."""
    addresses = AddressBuckets(limits.address_requests_per_s, limits.burst_s)
    upgrades = AddressBuckets(limits.address_upgrades_per_s, limits.burst_s)
    refused_log = _RefusalLog()
    per_address = limits.address_requests_per_s > 0
    per_connection = limits.requests_per_s > 0
    per_upgrade = limits.address_upgrades_per_s > 0
    forwarded = ForwardedFor(proxies) if proxies else None

    class Protocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            now = time.monotonic()
            self._budget = Bucket(limits.requests_per_s, limits.burst_s, now) if per_connection else None
            key = address_key(self.client, proxies, ipv6_prefix)
            self._key = key
            self._address = key if per_address else None
            self._refused = False
            self._counted = False  # held in ``connections``: released when the transport is gone
            if connections is not None:
                cap = connections.admit(key)
                if cap is not None:
                    self._refuse(cap, None)  # before anything is read
                else:
                    self._counted = True

        def connection_lost(self, exc: Exception | None) -> None:
            self._release()
            super().connection_lost(exc)

        def _release(self) -> None:
            if self._counted:
                self._counted = False
                connections.release(self._key)  # type: ignore[union-attr]

        def handle_websocket_upgrade(self) -> None:
            """The WebSocket protocol takes the transport, and with it the connection's count:
            released when that protocol's connection is lost."""
            super().handle_websocket_upgrade()
            taken = self.transport.get_protocol()
            if not self._counted or taken is self:
                return
            self._counted = False
            lost = taken.connection_lost
            key = self._key

            def connection_lost(exc: Exception | None) -> None:
                del lost.__self__.connection_lost  # no cycle (protocol, this patch) left to the collector
                connections.release(key)  # type: ignore[union-attr]
                lost(exc)

            taken.connection_lost = connection_lost

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def on_message_begin(self) -> None:
            if self._refused:
                raise _Stop
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            if self._refused:
                raise _Stop
            websocket = self.parser.should_upgrade() and self._should_upgrade()  # else served as HTTP
            why = self._charge_upgrade() if websocket else self._charge()
            if why is not None:
                self._refuse(*why)
                raise _Stop  # the parser stops: the rest of the read is never parsed
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if self._refused:
                raise _Stop
            super().on_body(body)

        def on_message_complete(self) -> None:
            if self._refused:
                raise _Stop
            super().on_message_complete()

        def send_400_response(self, msg: str) -> None:
            if not self._refused:  # else the parser failed because we stopped it
                super().send_400_response(msg)

        def _charge(self) -> tuple[str, bytes | None] | None:
            """The budget this request goes over and the answer to it, or None: serve it."""
            if len(self.pipeline) >= limits.pipeline_depth:
                return "http_pipeline_depth", None  # an earlier response is still due
            now = time.monotonic()
            if self._budget is not None and not self._budget.take(now):
                return "http_requests_per_s", _TOO_MANY
            if self._address is not None and not addresses.take(self._address, now):
                return "http_address_requests_per_s", _TOO_MANY
            if overload is not None:
                refused = overload.admit_request(self.url.partition(b"?")[0], overload.key(self._client()))
                if refused is not None:  # counted by the overload manager
                    return "", _TOO_MANY if refused == "over_share" else _UNAVAILABLE
            return None

        def _charge_upgrade(self) -> tuple[str, bytes | None] | None:
            """A WebSocket upgrade's charge: its address's upgrades, none of its HTTP budgets
            (none for loopback, this host: the benchmarks open 1,500 sessions at once)."""
            key = self._key
            if not per_upgrade or not counts_per_client(key) or upgrades.take(key, time.monotonic()):
                return None
            return "http_address_upgrades_per_s", _TOO_MANY

        def _client(self) -> str:
            """The client this request is charged to: the one a trusted proxy names, else the peer."""
            peer = self.client
            if not peer:
                return ""
            if forwarded is not None:
                scope = {"type": "http", "client": peer, "headers": self.headers}
                forwarded.rewrite(scope)
                peer = scope["client"]
            return peer[0]

        def _refuse(self, budget: str, answer: bytes | None) -> None:
            """Answer (where no earlier response is due) and close; the rest is never parsed."""
            self._refused = True
            self.logger = _QUIET  # uvicorn's "Invalid HTTP request" when the parser stops
            transport = self.transport
            if transport.is_closing():
                return
            if answer is not None and (self.cycle is None or self.cycle.response_complete):
                transport.write(answer)
            transport.close()
            if budget:
                over_budget(budget)
                peer = "{}:{}".format(*self.client) if self.client else "?"
                refused_log(budget, peer, time.monotonic())

    return Protocol
