"""Resume with no affinity: a resume that reaches a replica not holding its session is relayed,
as is, to the replica its token names (docs/protocol.md, "Resuming after a dropped connection").

A resume token is ``NAME.random`` (``--replica-id``). A replica that gets
``/v1/duplex?resume=NAME.random`` for another ``NAME`` opens a WebSocket to that peer, found by a
stable name (``--peer-url-template``, e.g. ``ws://{replica}:8998`` on compose, where the replica
id is the service name, or a StatefulSet pod's DNS name on Kubernetes), and relays every message
both ways byte for byte, text and binary, and the close code. It does no codec work: the session,
its codecs and its replay stay on the owner. Backpressure holds both ways: a message is read from
one side only once the last one was written to the other (the ASGI ``send`` waits while the
client's transport is over its high-water mark, ``websockets``' ``send`` while the peer's is),
and the peer's incoming queue is bounded, so a slow client stalls only its own relay.

Between replicas a request is authenticated by a shared secret (``--peer-secret``) in
:data:`SECRET_HEADER`, and marked as forwarded (:data:`HOP_HEADER`, the forwarder's name): the
owner serves such a request itself and never forwards it again, so no loop can form. The
client's own key travels with it (query, ``Authorization``, subprotocols), and the owner checks it.

The relay (:func:`relay`) knows the client only as ASGI ``receive``/``send`` and the peer only as
a ``websockets`` connection, so a live migration can reuse it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import websockets
import websockets.asyncio.client
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

SECRET_HEADER = "x-duplexserve-peer-secret"
HOP_HEADER = "x-duplexserve-forwarded-by"
#: Headers of the client's upgrade passed on to the owner (the key, the origin check, the log).
PASSED = (b"authorization", b"origin", b"user-agent")
#: Messages from the peer read ahead of the client at most (websockets' incoming queue).
PEER_QUEUE = 16
OPEN_TIMEOUT_S = 5.0
#: Close codes a close frame cannot carry (RFC 6455 7.4.1): the other side sees a drop instead.
UNSENDABLE = frozenset({1005, 1006, 1015})


@dataclass(slots=True)
class ForwardCounts:
    forwarded: int = 0  # relayed to the owner
    failed: int = 0  # the owner was unknown or unreachable: resume_failed here
    refused: int = 0  # a forwarded request that failed the peer check or would hop again


class PeerForwarder:
    """Which resumes go to a peer, and where; the peer check on forwarded requests."""

    def __init__(self, replica_id: str, url_template: str, secret: str) -> None:
        self.replica_id = replica_id
        self.url_template = url_template
        self.secret = secret
        self.counts = ForwardCounts()

    @staticmethod
    def _header(scope: Scope, name: str) -> str | None:
        key = name.encode()
        return next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == key), None)

    def owner(self, scope: Scope) -> str | None:
        """The replica named by this upgrade's resume token when it is another one; else None."""
        if scope.get("path") != "/v1/duplex" or not self.replica_id \
                or b"resume=" not in scope.get("query_string", b""):  # a new session: no parse
            return None
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True))
        name, dot, _ = query.get("resume", "").partition(".")
        return name if dot and name and name != self.replica_id else None

    def check(self, scope: Scope) -> tuple[str, str] | None:
        """(error code, message) to refuse a forwarded request with; None to serve it (it may
        be no forwarded request at all, or one whose owner is this replica)."""
        hop = self._header(scope, HOP_HEADER)
        if hop is None:
            return None
        given = self._header(scope, SECRET_HEADER) or ""
        if not self.secret or not hmac.compare_digest(given.encode(), self.secret.encode()):
            self.counts.refused += 1
            return "unauthorized", "a forwarded resume needs this fleet's peer secret"
        name = self.owner(scope)
        if name is not None:
            self.counts.refused += 1
            return "resume_failed", f"forwarded by {hop}, the token names {name}: a resume is forwarded once"
        return None

    def url_of(self, name: str, scope: Scope) -> str | None:
        if not (self.url_template and self.secret):
            return None
        base = self.url_template.format(replica=name).rstrip("/")
        query = scope.get("query_string", b"").decode("latin-1")
        return f"{base}{scope['path']}?{query}"

    def headers(self, scope: Scope) -> list[tuple[str, str]]:
        """The client's headers the owner needs, the client as this replica sees it (the owner
        believes it only if it lists this replica in --forwarded-allow-ips), and the hop."""
        passed = [(k.decode(), v.decode("latin-1")) for k, v in scope.get("headers", ()) if k in PASSED]
        client = scope.get("client")
        if client:
            passed.append(("x-forwarded-for", client[0]))
        return [*passed, (HOP_HEADER, self.replica_id), (SECRET_HEADER, self.secret)]

    async def forward(self, name: str, scope: Scope, receive: Receive, send: Send) -> str | None:
        """Relay this connection (its ``websocket.connect`` already received) to replica
        ``name``. None once relayed to its end; else why the peer could not be reached, with
        nothing sent to the client yet."""
        url = self.url_of(name, scope)
        if url is None:
            self.counts.failed += 1
            return (f"the token names replica {name!r}, and this replica forwards no resume "
                    "(--peer-url-template and --peer-secret)")
        asked = self._header(scope, "sec-websocket-protocol") or ""
        offered = [p.strip() for p in asked.split(",") if p.strip()]
        try:
            peer = await websockets.asyncio.client.connect(
                url, additional_headers=self.headers(scope), subprotocols=offered or None,  # type: ignore[arg-type]
                compression=None, max_size=None, max_queue=PEER_QUEUE, open_timeout=OPEN_TIMEOUT_S,
                ping_interval=None, user_agent_header=None,
            )
        except (OSError, TimeoutError, websockets.InvalidHandshake, websockets.InvalidURI) as exc:
            self.counts.failed += 1
            return f"replica {name!r} holding the session could not be reached: {type(exc).__name__}"
        self.counts.forwarded += 1
        accept: dict[str, Any] = {"type": "websocket.accept"}
        if peer.subprotocol:
            accept["subprotocol"] = peer.subprotocol
        try:
            await send(accept)
        except (OSError, RuntimeError):
            peer.transport.abort()
            return None
        await relay(receive, send, peer)
        return None


async def relay(receive: Receive, send: Send, peer: Any) -> None:
    """Move messages between an accepted ASGI WebSocket and a ``websockets`` connection until
    either ends, then end the other the same way: a close code is passed on, a drop is a drop."""

    async def client_to_peer() -> None:
        while True:
            message = await receive()
            if message["type"] != "websocket.receive":  # websocket.disconnect
                code = message.get("code", 1000)
                if code in UNSENDABLE:
                    peer.transport.abort()  # the owner sees a drop, and keeps the session for a resume
                else:
                    with contextlib.suppress(websockets.ConnectionClosed, OSError):
                        await peer.close(code, message.get("reason") or "")
                return
            data = message.get("bytes")
            await peer.send(data if data is not None else message.get("text") or "")

    async def peer_to_client() -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for data in peer:
                if isinstance(data, bytes):
                    await send({"type": "websocket.send", "bytes": data})
                else:
                    await send({"type": "websocket.send", "text": data})
        closed = peer.protocol.close_rcvd
        code = 1011 if closed is None else (1000 if closed.code in UNSENDABLE else closed.code)
        reason = "" if closed is None else closed.reason
        await send({"type": "websocket.close", "code": code, "reason": reason})

    up = asyncio.create_task(client_to_peer())
    down = asyncio.create_task(peer_to_client())
    try:
        await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (up, down):
            task.cancel()
        for task in (up, down):
            with contextlib.suppress(asyncio.CancelledError, websockets.ConnectionClosed, OSError,
                                     RuntimeError):
                await task
        if peer.protocol.close_rcvd is None and peer.protocol.close_sent is None:
            peer.transport.abort()


class PeerForwardCollector(Collector):
    def __init__(self, forwarder: PeerForwarder) -> None:
        self.forwarder = forwarder

    def collect(self) -> Any:
        family = CounterMetricFamily(
            "duplexserve_resume_forwards",
            "resumes for a session on another replica: forwarded to it, failed (unknown or unreachable), "
            "refused (a forwarded resume without the peer secret, or one that would hop again)",
            labels=["outcome"],
        )
        c = self.forwarder.counts
        for outcome, value in (("forwarded", c.forwarded), ("failed", c.failed), ("refused", c.refused)):
            family.add_metric([outcome], value)
        yield family
