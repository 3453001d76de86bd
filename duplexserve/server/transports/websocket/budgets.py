"""What one WebSocket connection may cost the loop, enforced where its bytes arrive.

Every session shares one event loop thread, so a connection that sends faster than any
client needs (pings, tiny messages, bytes) must neither hold the loop nor take more than
its share of it. Two things bound it, in :class:`MeteredProtocol`, the base of both our
uvicorn protocols (the fast path, server/transports/websocket/protocol.py, and the ASGI fallback,
server/transports/websocket/fallback.py):

- a slice: one wake-up parses at most :data:`SLICE_FRAMES` frames or about
  :data:`SLICE_BYTES` bytes; the rest waits, reading paused, for a ``call_soon`` turn,
  after every other socket's (a flood delays another connection's frame by one slice,
  about a millisecond, instead of the whole read);
- token buckets (:class:`Meter`): frames, control frames and bytes a second, each with a
  burst of ``burst_s`` seconds of its rate. A connection past one is closed 1008 (its
  close frame says which budget), counted (``over_budget``) and logged once; one whose
  close frame was already sent (refused, or closing) is aborted at once: it is not read
  on. Bytes are charged once per read, frames once per slice (the cost per frame is an
  integer add), and the clock is read only when a bucket runs short;
- the loop's time handling text messages (JSON: a byte of it may cost 50 times another),
  measured per message on the fast path as the loop thread's CPU time (not inflated when the
  host preempts it) (:class:`ParseMeter`): a few control events a second
  and audio as JSON (Realtime's appends, Twilio's media) cost a session a few ms a second, and
  a connection may spend ``ParseLimits.connection_ms_per_s``, its address (not loopback nor a
  trusted proxy; IPv6 by ``--client-ipv6-prefix``) ``address_ms_per_s`` over all its
  connections, each ``burst_s`` ahead; past either it is closed 1008 as above. Eight
  connections of 1 MB JSON messages, each under the byte budget, saturated the loop (issue
  67); what all connections spend together is the overload manager's (server/overload.py),
  which sheds new work past its ceiling;
- the client's fair share of the loop (issue 73): each message's handling is also charged
  to the connection's client (the one a trusted proxy names) in the overload manager, which
  near the loop's capacity closes the costliest connections of clients over their share
  (:meth:`MeteredProtocol.cut`) and refuses their next message (``fair_share``).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from duplexserve.errors import POLICY
from duplexserve.server.core.budgets import over_budget
from duplexserve.server.core.token_buckets import AddressBuckets, Bucket, address_key

log = logging.getLogger("duplexserve")

#: One wake-up parses at most this many frames of a connection ...
SLICE_FRAMES = 64
#: ... or about this many bytes (a frame is not cut: one frame may be larger).
SLICE_BYTES = 1 << 18
#: The close frame's reason for a connection closed for a budget: this prefix, then the budget.
OVER_BUDGET = "over budget: "
#: A connection closed for a budget: how long it has to read its close frame (reading
#: paused: what it still sends is never read) before the transport closes.
DROP_LINGER_S = 2.0


#: What :class:`MeteredProtocol` reads of uvicorn's ``WebSocketsSansIOProtocol`` (state set in
#: its ``__init__``, methods it overrides or calls) and of websockets' ``ServerProtocol``;
#: checked once at start-up (protocol.py).
METERED_STATE = (
    "loop", "queue", "conn", "client", "handshake_initiated", "handshake_complete", "close_sent",
    "close_timer", "read_paused", "frames", "curr_msg_data_type",
)  # fmt: skip
METERED_METHODS = (
    "data_received", "receive", "handle_connect", "send_receive_event_to_app", "connection_lost",
)  # fmt: skip
#: The scope extension by which the ASGI path's reader charges a text message's handling
#: (``{"charge": seconds -> None}``): uvicorn queues the message, the app handles it later.
PARSE_EXTENSION = "duplexserve.parse_charge"
METERED_WEBSOCKETS_METHODS = ("send_close", "data_to_send")


@dataclass(frozen=True, slots=True)
class RateLimits:
    """Rates a connection may keep up, each allowed ``burst_s`` seconds ahead; 0: no limit."""

    frames_per_s: float = 5000.0
    control_frames_per_s: float = 50.0
    bytes_per_s: float = float(32 << 20)
    burst_s: float = 4.0


@dataclass(frozen=True, slots=True)
class ParseLimits:
    """The loop's time a connection, and an address over all its connections, may spend
    handling text messages, in ms a second, ``burst_s`` seconds of it at once; 0: no limit."""

    connection_ms_per_s: float = 25.0
    address_ms_per_s: float = 100.0
    burst_s: float = 1.0  # a session's largest event (a 16 KiB prompt) costs well under 1 ms


class ParseMeter:
    """The loop's time handling text messages: per connection and per address (buckets of
    seconds), and in all (``spent_s``, read by the overload manager)."""

    def __init__(self, limits: ParseLimits, proxies: list[str], ipv6_prefix: int = 64) -> None:
        self.limits = limits
        self._proxies = proxies
        self._ipv6_prefix = ipv6_prefix
        rate = limits.address_ms_per_s / 1000
        self._addresses = AddressBuckets(rate, limits.burst_s) if rate > 0 else None
        self.spent_s = 0.0  # in all, since the start
        self._taken_s = 0.0
        #: The overload manager: charges each message to its client's fair share (set by the app).
        self.fair: Any = None

    def take_spent(self) -> float:
        """Seconds spent in all since the last call."""
        spent, self._taken_s = self.spent_s - self._taken_s, self.spent_s
        return spent

    def connection(self, now: float) -> Bucket | None:
        rate = self.limits.connection_ms_per_s / 1000
        return Bucket(rate, self.limits.burst_s, now) if rate > 0 else None

    def address(self, client: tuple[str, int] | None) -> str | None:
        """The address charged for ``client``'s connections: None for loopback (this host: the
        benchmarks, a proxy beside the server), a trusted proxy, or with no address budget."""
        key = address_key(client, self._proxies, self._ipv6_prefix) if self._addresses is not None else None
        if key is None or ipaddress.ip_network(key, strict=False).is_loopback:
            return None
        return key

    def take_address(self, address: str, now: float, seconds: float) -> bool:
        assert self._addresses is not None
        return self._addresses.take(address, now, seconds)

    def address_has(self, address: str, now: float, seconds: float) -> bool:
        assert self._addresses is not None
        return self._addresses.has(address, now, seconds)


#: What a text message is taken to cost before it is handled (dense JSON, as numbers, is 11-20
#: ns a byte to ``json.loads``; Realtime's base64 audio less): a message its budget cannot hold
#: at this rate is refused unhandled.
PARSE_S_PER_BYTE = 1e-8

DEFAULT_LIMITS = RateLimits()
#: No budget (the slices still apply): the fast path of the benchmarks' echo floors.
UNLIMITED = RateLimits(0.0, 0.0, 0.0)


class Meter:
    """Three token buckets, full at the start; charges are subtracted as they come, and
    only a bucket that runs below zero is refilled for the time since the last refill (no
    clock read per read or per frame). A bucket that sat full meanwhile is credited for
    that time too, so a connection may send up to twice its burst at once, never more than
    its rate for longer."""

    __slots__ = ("_at", "_caps", "_rates", "bytes", "controls", "frames")

    def __init__(self, limits: RateLimits, now: float) -> None:
        rates = (limits.frames_per_s, limits.control_frames_per_s, limits.bytes_per_s)
        self._rates = tuple(r if r > 0 else 0.0 for r in rates)
        self._caps = tuple(r * limits.burst_s if r > 0 else math.inf for r in rates)
        self.frames, self.controls, self.bytes = self._caps
        self._at = now

    def refill(self, now: float) -> str | None:
        """Credit the time since the last refill; the budget still spent, if one is."""
        elapsed, self._at = now - self._at, now
        (fr, cr, br), (fc, cc, bc) = self._rates, self._caps
        self.frames = min(fc, self.frames + elapsed * fr)
        self.controls = min(cc, self.controls + elapsed * cr)
        self.bytes = min(bc, self.bytes + elapsed * br)
        if self.frames < 0:
            return "frames_per_s"
        if self.controls < 0:
            return "control_frames_per_s"
        return "bytes_per_s" if self.bytes < 0 else None


class MeteredProtocol(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O protocol with :class:`Meter` budgets and slice bookkeeping; the
    subclasses call :meth:`_arrived` for each read and :meth:`_spent` after each slice."""

    limits = RateLimits()
    parse: ParseMeter | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.meter = Meter(self.limits, self.loop.time())
        self._parse_started = False  # the buckets below are made at the first text message
        self._parse_bucket: Bucket | None = None
        self._parse_address: str | None = None
        self._fair_client = ""  # the client charged for its messages' handling (overload manager)
        self._yielding = False  # a slice's continuation is scheduled; reading paused meanwhile
        self._dropping = False  # over a budget: nothing more is read or parsed
        #: The budget this connection went over (its session ends, not resumable), or None.
        self.over: str | None = None

    def _arrived(self, size: int) -> bool:
        """Charge one read of ``size`` bytes; False: drop it (over a budget, now or before)."""
        if self._dropping:  # reading resumed by someone: stop it again, drop this
            self.transport.pause_reading()
            return False
        meter = self.meter
        meter.bytes -= size
        return meter.bytes >= 0 or self._short()

    def _spent(self, frames: int, controls: int) -> None:
        """Charge one slice's frames; a connection over budget is closed or dropped."""
        meter = self.meter
        meter.frames -= frames
        meter.controls -= controls
        if meter.frames < 0 or meter.controls < 0:
            self._short()

    def _affords(self, size: int) -> bool:
        """Whether a text message of ``size`` bytes may be handled: its budgets hold what it
        would cost at :data:`PARSE_S_PER_BYTE`; else the connection is closed or dropped
        now, before it is handled (a 1 MB message is 10-20 ms of the loop)."""
        parse = self.parse
        if parse is None:
            return True
        if not self._parse_started:
            self._parse_started = True
            self._parse_bucket = parse.connection(self.loop.time())
            self._parse_address = parse.address(self.client)
            if parse.fair is not None:
                scope = getattr(self, "scope", None)  # its client rewritten for a trusted proxy's
                client = scope.get("client") if scope is not None else self.client
                self._fair_client = parse.fair.key(client[0]) if client else ""
        if parse.fair is not None and parse.fair.refuses(self._fair_client, time.monotonic()):
            self._over("fair_share")
            return False
        bucket, address = self._parse_bucket, self._parse_address
        if bucket is None and address is None:
            return True
        now, cost = self.loop.time(), size * PARSE_S_PER_BYTE
        if bucket is not None and not bucket.has(now, cost):
            self._over("parse_ms_per_s")
            return False
        if address is not None and not parse.address_has(address, now, cost):
            self._over("address_parse_ms_per_s")
            return False
        return True

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None and self.parse is not None:
            scope["extensions"][PARSE_EXTENSION] = {"charge": self._parsed}

    def send_receive_event_to_app(self) -> None:
        """The ASGI path (uvicorn queues each message for the app): a text message its parse
        budgets cannot hold is refused unread, as on the fast path; the app's reader charges
        the handling of the others (:data:`PARSE_EXTENSION`, ``AsgiDriver``)."""
        text = self.curr_msg_data_type == "text" and not self.close_sent
        if text and not self._affords(sum(len(f) for f in self.frames)):
            self.frames = []
            return
        super().send_receive_event_to_app()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        scope = getattr(self, "scope", None)
        if scope is not None:  # no cycle (scope, charge, protocol) left to the collector
            scope["extensions"].pop(PARSE_EXTENSION, None)
        if self.parse is not None and self.parse.fair is not None and self._parse_started:
            self.parse.fair.forget(self._fair_client, self)

    def cut(self) -> None:
        """Closed by the overload manager: its client is over its fair share of the loop."""
        self._over("fair_share")

    def _parsed(self, seconds: float) -> None:
        """Charge the loop's time handling one text message (:class:`ParseMeter`), after
        :meth:`_affords`; a connection over its budget or its address's is closed or dropped."""
        parse = self.parse
        if parse is None:
            return
        parse.spent_s += seconds
        if parse.fair is not None:
            parse.fair.charge(self._fair_client, self, seconds, time.monotonic())
        bucket, address = self._parse_bucket, self._parse_address
        if bucket is None and address is None:
            return
        now = self.loop.time()
        if bucket is not None and not bucket.take(now, seconds):
            self._over("parse_ms_per_s")
        elif address is not None and not parse.take_address(address, now, seconds):
            self._over("address_parse_ms_per_s")

    def _short(self) -> bool:
        """A bucket ran short: refill them; False (and closed or dropped) if still short."""
        budget = self.meter.refill(self.loop.time())
        if budget is None:
            return True
        self._over(budget)
        return False

    def _over(self, budget: str) -> None:
        if self._dropping:
            return
        self._dropping = True
        self.over = budget
        over_budget(budget)
        transport = self.transport
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
        if self.close_sent or not self.handshake_complete or transport.is_closing():
            log.warning("WebSocket %s over its %s budget after its close: dropped", peer, budget)
            transport.abort()
            return
        log.warning("WebSocket %s over its %s budget: closed 1008", peer, budget)
        reason = OVER_BUDGET + budget
        self.queue.put_nowait({"type": "websocket.disconnect", "code": POLICY, "reason": reason})
        self.conn.send_close(POLICY, reason)
        transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self.close_timer = self.loop.call_later(DROP_LINGER_S, transport.close)
        transport.pause_reading()  # what it still sends costs nothing, and is never read
        self._app_gone()

    def _app_gone(self) -> None:
        """The connection was closed for a budget: tell the app that is not reading uvicorn's
        queue (the fast path's callbacks)."""

    def _slice_cut(self) -> None:
        """Stop here for this wake-up: reading pauses, and :meth:`_next_slice` runs after
        every other ready callback and socket of this turn of the loop."""
        if not self._yielding:
            self._yielding = True
            self.transport.pause_reading()
            self.loop.call_soon(self._next_slice)

    def _next_slice(self) -> None:
        raise NotImplementedError

    async def receive(self) -> Any:
        """uvicorn's, except that reading resumes only once no slice waits for its turn."""
        message = await self.queue.get()
        if self.read_paused and self.queue.empty():
            self.read_paused = False
            if not self._yielding and not self._dropping:
                self.transport.resume_reading()
        return message


def budgeted(
    cls: type[MeteredProtocol], limits: RateLimits, parse: ParseMeter | None = None
) -> type[MeteredProtocol]:
    """``cls`` with ``limits`` and ``parse`` (uvicorn builds each connection's protocol from the class)."""
    return type(cls.__name__, (cls,), {"limits": limits, "parse": parse, "__module__": cls.__module__})
