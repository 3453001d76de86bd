"""Run the app under uvicorn (uvloop, httptools, deflate off) with a graceful drain.

uvicorn's own shutdown closes every WebSocket at once with 1012. Ours drains first: on
SIGTERM (or SIGINT) the server stops admitting (/ready turns 503, new sessions get
1013), moves each duplex/1 session it can to a peer of ``--peers`` (server/peer_move.py),
lets the other live sessions finish for ``--drain-grace-s``, closes the rest with
``server_shutdown`` and their counts, and only then lets uvicorn exit. A second signal
exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from duplexserve.config import ServerConfig
from duplexserve.server import auth, log_redaction
from duplexserve.server.app import DuplexApp, create_app
from duplexserve.server.connection_caps import (
    Connections,
    ConnectionsCollector,
    connection_caps,
    descriptor_limit,
)
from duplexserve.server.core.budgets import over_budget
from duplexserve.server.http_budgets import HttpLimits, budgeted_http
from duplexserve.server.transports.websocket.budgets import (
    DEFAULT_LIMITS,
    UNLIMITED,
    MeteredProtocol,
    ParseMeter,
    RateLimits,
    budgeted,
)
from duplexserve.server.transports.websocket.fallback import SansIOFallback
from duplexserve.server.transports.websocket.protocol import (
    FastWebSocketProtocol,
    fallback_problem,
    fast_path_problem,
)

log = logging.getLogger("duplexserve")

#: The most bytes a request may send before its headers are complete (the request line
#: and headers: an upgrade with its token and cookies needs a few KiB). httptools keeps a
#: header it has not seen the end of, so without a bound one connection could grow the
#: server by the megabytes it sends until the handshake timeout.
MAX_HEAD_BYTES = 64 << 10
_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
)


def handshake_limited(timeout_s: float) -> type[HttpToolsProtocol]:
    """An HTTP protocol that drops connections whose request headers do not arrive in time
    and answers 431 to a request whose head grows past :data:`MAX_HEAD_BYTES`.

    Every head has the deadline: the first from the connection's start, each later one on a
    kept-alive connection from its first byte (uvicorn cancels its keep-alive timer there, so
    a second head that never ended held the connection for ever: issue 73), blank lines
    before a request line included (llhttp skips them without a callback)."""

    class Protocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
            super().connection_made(transport)
            self._handshake_timer = self.loop.call_later(timeout_s, self._handshake_expired)
            self._head_bytes: int | None = 0  # None: between a head's end and the next request
            self._heads = 0  # heads complete so far on this connection
            self._awaiting_head = False  # a request ended: the next byte starts a head

        def data_received(self, data: bytes) -> None:
            if self._awaiting_head and data:  # the first byte of the next head: its deadline
                self._arm_head_timer()
            if self._head_bytes is not None:
                room = MAX_HEAD_BYTES - self._head_bytes
                if len(data) > room:  # the head may still end in this read, its body after it
                    heads = self._heads
                    self._head_bytes = MAX_HEAD_BYTES
                    super().data_received(data[:room])
                    if self._heads != heads:  # it did: the rest is body (or the next request)
                        if self.transport.get_protocol() is self and not self.transport.is_closing():
                            self.data_received(data[room:])
                        return
                    self._head_bytes = None
                    self._handshake_timer.cancel()
                    if not self.transport.is_closing():
                        over_budget("request_head")
                        self.transport.write(_HEAD_TOO_LARGE)
                        self.transport.close()
                    return
                self._head_bytes += len(data)
            super().data_received(data)

        def on_message_begin(self) -> None:
            if self._awaiting_head:  # the next head began in the read that ended the last request
                self._arm_head_timer()
            if self._head_bytes is None:  # the next request on a kept-alive connection
                self._head_bytes = 0
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._handshake_timer.cancel()
            self._head_bytes = None
            self._heads += 1
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._awaiting_head = True

        def connection_lost(self, exc: Exception | None) -> None:
            self._handshake_timer.cancel()
            super().connection_lost(exc)

        def _handshake_expired(self) -> None:
            if not self.transport.is_closing():
                self.transport.close()

        def _arm_head_timer(self) -> None:
            self._awaiting_head = False
            self._handshake_timer = self.loop.call_later(timeout_s, self._head_expired)

        def _head_expired(self) -> None:
            """A later head past its deadline: counted, as it is a kept-alive connection held."""
            if not self.transport.is_closing():
                over_budget("request_head_time")
                self.transport.close()

    return Protocol


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: DuplexApp, grace_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.grace_s = grace_s
        self._draining = False
        self._drain: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if sockets is not None and self.started:  # uvicorn says where it listens only on sockets it bound
            self._log_started_message(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self.should_exit:
            super().handle_exit(sig, frame)  # second signal: go now
            return
        self._draining = True
        asyncio.get_event_loop().call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        orch = self.app.orchestrator
        await self.app.mover.drain()  # first, each session that can move goes to a peer (peer_move.py)
        log.info("draining %d sessions for up to %.0f s", orch.active, self.grace_s)
        await orch.drain(self.grace_s)
        await asyncio.sleep(0.5)  # let writers send session.closed and the close frames
        self.should_exit = True


def websocket_protocol(
    ws: str, limits: RateLimits | None = DEFAULT_LIMITS, parse: ParseMeter | None = None
) -> str | type[MeteredProtocol]:
    """``--ws fast`` where the installed uvicorn and websockets have what the fast path
    reads (checked once, here), else uvicorn's own sans-I/O protocol, said once; that one,
    ``--ws websockets-sansio``, with the same budgets and slices (server/transports/websocket/fallback.py)
    where it has what they read, else as it comes, said too. ``limits`` None: uvicorn's
    protocols as they come and no budget on the fast path (the benchmarks' echo floors)."""
    if ws == "fast":
        problem = fast_path_problem()
        if problem is None:
            return budgeted(FastWebSocketProtocol, limits or UNLIMITED, parse if limits else None)
        log.warning(
            "WebSocket fast path off, serving on uvicorn's websockets-sansio protocol: %s "
            "(the fast path needs uvicorn>=0.53 and websockets>=13; docs/architecture.md)",
            problem,
        )
        ws = "websockets-sansio"
    if ws == "websockets" and limits is not None:  # uvicorn's legacy protocol: no way to budget it
        log.warning("--ws websockets served as websockets-sansio, the protocol with per-connection budgets")
        ws = "websockets-sansio"
    if ws != "websockets-sansio" or limits is None:
        return ws
    problem = fallback_problem()
    if problem is None:
        return budgeted(SansIOFallback, limits, parse)
    log.warning("uvicorn's websockets-sansio protocol served without per-connection budgets: %s", problem)
    return ws


def rate_limits(config: ServerConfig) -> RateLimits:
    return RateLimits(
        config.ws_max_frames_per_s, config.ws_max_control_frames_per_s, config.ws_max_bytes_per_s,
        config.ws_budget_burst_s,
    )  # fmt: skip


def http_protocol(config: ServerConfig, app: object) -> type[HttpToolsProtocol]:
    """The HTTP protocol with its request budgets and the app's overload manager, if it has one."""
    base = handshake_limited(config.handshake_timeout_s)
    proxies = list(auth.parse_list(config.forwarded_allow_ips))
    limit = descriptor_limit()
    caps = connection_caps(limit, config.max_connections_per_client)
    log.info(
        "connections: at most %d in all, %s per client (RLIMIT_NOFILE %d)",
        caps.total, caps.per_client or "no limit", limit,
    )  # fmt: skip
    connections = Connections(caps)
    metrics = getattr(app, "metrics", None)
    if metrics is not None:
        metrics.registry.register(ConnectionsCollector(connections))
    overload = getattr(app, "overload", None)
    return budgeted_http(base, HttpLimits(), overload, proxies, config.client_ipv6_prefix, connections)


def uvicorn_config(config: ServerConfig, app: object, budgets: bool = True) -> uvicorn.Config:
    """uvicorn's settings for ``config``; ``budgets`` False: the WebSocket protocols with no
    budget, uvicorn's as they come (the benchmarks' echo floors)."""
    # No proxy headers here: the app reads X-Forwarded-For itself (core/client_address.py), from
    # the right and from --forwarded-allow-ips only, where uvicorn's middleware would take the
    # client-written leftmost entry under "*" (and trusts loopback by default).
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        http=http_protocol(config, app) if budgets else handshake_limited(config.handshake_timeout_s),
        ws=websocket_protocol(
            config.ws, rate_limits(config) if budgets else None, getattr(app, "parse", None)
        ),
        ws_per_message_deflate=False,
        # A hard backstop above our own limit, which answers with an error event first.
        ws_max_size=2 * config.max_message_bytes + 1024,
        lifespan="on",
        log_level=config.log_level,
        access_log=False,
        proxy_headers=False,
        backlog=4096,
        timeout_graceful_shutdown=5,
    )


#: WebRTC's libraries: aioice logs each ICE check at INFO, about ten lines a call.
QUIET_BELOW_DEBUG = ("aioice", "aiortc")


#: uvicorn's INFO lines for every WebSocket (its handshake's outcome, "connection open" and
#: "closed"): a client reconnecting without a key wrote 2-3 lines a try, 1.4 MB in 10 s.
PER_CONNECTION_LINES = frozenset(
    {'%s - "WebSocket %s" [accepted]', '%s - "WebSocket %s" 403', '%s - "WebSocket %s" %d', "connection open"}
)


def per_connection_line(record: logging.LogRecord) -> bool:
    """False for uvicorn's per-connection lines below WARNING (a filter of ``uvicorn.error``)."""
    return record.levelno >= logging.WARNING or record.msg not in PER_CONNECTION_LINES


def serve(config: ServerConfig, sock: socket.socket) -> None:
    """Serve ``config`` on ``sock``, bound by ``duplexserve.listen.listen_socket``."""
    log_redaction.install()  # the root's handler; uvicorn's come with its config
    if config.log_level != "debug":
        for name in QUIET_BELOW_DEBUG:
            logging.getLogger(name).setLevel(logging.WARNING)
    app = create_app(config)
    app.freeze_gc = True
    server_config = uvicorn_config(config, app)  # configures uvicorn's log handlers
    if config.log_level != "debug":
        logging.getLogger("uvicorn.error").addFilter(per_connection_line)
    log_redaction.install()
    if not config.api_keys and config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("no --api-keys: anyone who reaches %s:%d can open sessions", config.host, config.port)
    DrainingServer(server_config, app, config.drain_grace_s).run(sockets=[sock])
