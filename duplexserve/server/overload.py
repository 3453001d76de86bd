"""The loop protects itself: measure how late it runs, and shed what is not live audio first.

Every session's frames go through one event loop thread, and the engine thread needs that
thread's GIL back after each of its hand-offs (engine_bridge/process_engine.py). A loop kept
busy by work no live session needs (HTTP requests, new sessions, large JSON events) makes
every session's frames late at once. In the spirit of Envoy's overload manager, two
resources are watched and one action taken:

- the loop's lag: a timer due every :data:`PROBE_S` seconds, and how late it runs;
- the engine thread's GIL wait: how long its latest hand-offs waited for the GIL after the
  engine had answered (``EngineBridge.counts.gil_wait_max_s``, reset at each probe);
- the loop's time handling WebSocket text messages, all connections together
  (transports/websocket/budgets.py, ``ParseMeter``): the global ceiling on parse work.

Past any threshold in ``sustain`` probes in a row (:class:`Thresholds`) the server is
*overloaded*, until all have been under half of theirs for ``calm_s``. While overloaded it
sheds, cheapest to refuse first: new HTTP requests (503, the connection closed) but for a
small reserve of probes (``/health``, ``/ready``, ``/metrics``; a few a second to one
address), then new sessions (refused 1013, or 503 with ``--refuse-with-http-503``, before any
work). Live sessions are never shed. Outside overload, a global ceiling on HTTP requests a
second bounds the parse work all connections together may ask of the loop. Everything shed
is counted (``duplexserve_overload_shed_total{work}``); docs/reliability.md lists it all.

Shedding falls on whoever causes it (issue 73; server/core/fair_share.py): each client's HTTP
requests, upgrades and text-message handling are charged to it (the client: the forwarded one
behind a trusted proxy, IPv6 by ``--client-ipv6-prefix``), and the HTTP ceiling, the probes'
reserve and the loop's time are each shared among the active clients. As the loop nears its
capacity the clients over their share are cut first (their costliest connections closed,
their requests 429, their new sessions 1013), and a client under its share is still served
while the overload is someone's; only an overload no client is over its share for sheds all.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from duplexserve.server.core.client_address import client_key
from duplexserve.server.core.fair_share import FairShare
from duplexserve.server.core.token_buckets import AddressBuckets

#: How often the loop's lag is probed (a timer due this often; its lateness is the lag).
PROBE_S = 0.05
#: HTTP paths that answer probes (a load balancer's, Prometheus'): served from the reserve.
PROBES = frozenset({b"/health", b"/ready", b"/metrics"})
#: A step's wait for the GIL stands this long when no step follows (steps come every 80 ms).
GIL_CARRY_S = 0.2
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
#: What is shed, for the counter's label (the order it is shed in, cheapest first).
SHED_WORK = ("http_request", "session")
#: What a client over its share loses (``duplexserve_fair_share_cut_total{work}``).
CUT_WORK = ("http_request", "session", "connection")
#: What an HTTP request and a WebSocket upgrade are taken to cost the loop (FastAPI's routing of
#: a request is about 100 us; an upgrade's handshake and session set-up more), charged to the client.
HTTP_REQUEST_S = 1e-4
UPGRADE_S = 1e-3
#: Never less than this of the loop's time is a client's share (an honest session's control
#: events are well under a ms a second) ...
LOOP_FLOOR_S = 0.02
#: ... nor fewer requests a second of the HTTP ceiling, nor probes of the reserve.
HTTP_FLOOR = 2.0
PROBE_FLOOR = 0.5
#: While the loop lags, the HTTP ceiling is cut by this factor a probe, down to this part of
#: it; calm, it grows back by this part of it a probe (a second from the least to the whole).
CEILING_CUT = 0.8
CEILING_MIN = 0.1
CEILING_GROW = 0.05
#: The loop nears its capacity when the clients' charged work passes this part of it.
PRESSED = 0.8
#: An overload is someone's while a client was over its share this recently: until then,
#: clients under their share are served as usual.
BLAME_S = 3.0


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When the server counts as overloaded, and what it still lets through then."""

    loop_lag_s: float = 0.05  # a frame on time (80 ms) still has most of its period
    gil_wait_s: float = 0.02  # a quarter frame of hand-off waits in one probe period
    parse_share: float = 0.5  # of the loop's time, handling text messages in all (0: no ceiling)
    #: Overloaded once this many probes in a row are over a threshold (200 ms): a pause of the
    #: collector or the host's scheduler is no overload, a flood is.
    sustain: int = 4
    calm_s: float = 1.0  # overloaded until this long under half of both thresholds
    probe_reserve_per_s: float = 50.0  # probes served a second while overloaded, in all ...
    address_probes_per_s: float = 2.0  # ... and to one address (a flood of /health is no probe)
    http_requests_per_s: float = 1000.0  # the global ceiling on HTTP requests (0: none)


class Cuttable(Protocol):
    """A connection the overload manager may close for its client's share (a WebSocket's)."""

    def cut(self) -> None: ...


class OverloadManager:
    """Watches the loop's lag and the engine thread's GIL wait; says what to shed."""

    def __init__(
        self,
        thresholds: Thresholds,
        gil_wait: Callable[[], float],
        parse_work: Callable[[], float],
        ipv6_prefix: int = 64,
    ) -> None:
        self.thresholds = thresholds
        self._gil_wait = gil_wait  # the largest hand-off wait since the last call, then reset
        self._parse_work = parse_work  # the loop's time handling text messages since the last call
        self.parse_s = 0.0  # all of it, since the start
        self.ipv6_prefix = ipv6_prefix
        #: Each client's share of the probes' reserve, of the HTTP ceiling and of the loop's time.
        self._probes = FairShare(thresholds.probe_reserve_per_s, PROBE_FLOOR)
        self._address_probes = AddressBuckets(thresholds.address_probes_per_s, 2.0)
        rate = thresholds.http_requests_per_s
        self._requests = FairShare(rate, HTTP_FLOOR) if rate > 0 else None
        self.loop_share = FairShare(thresholds.parse_share or 0.5, LOOP_FLOOR_S)
        self.pressed = False  # the loop nears its capacity: clients over their share are cut
        self._blamed_at = -BLAME_S  # when a client was last over its share while pressed
        self._conns: dict[str, dict[Cuttable, float]] = {}  # client: connection: its parse seconds
        self.cut: Counter[str] = Counter()
        self.overloaded = False
        self.lag_s = 0.0  # the latest probe's
        self.gil_s = 0.0  # the latest probe period's largest hand-off wait
        self.episodes = 0  # times the server became overloaded
        self.overloaded_s = 0.0  # time spent overloaded: the time between probes while overloaded
        self._observed_at: float | None = None
        self.shed: Counter[str] = Counter()
        self.lag_buckets = [0] * (len(LAG_BUCKETS) + 1)
        self.lag_sum = 0.0
        self._calm_since: float | None = None
        self._hot = 0  # probes in a row over a threshold
        self._gil_at = -GIL_CARRY_S  # when a step's wait was last seen
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0

    # ------------------------------------------------------------------ probing
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._due = loop.time() + PROBE_S
        self._timer = loop.call_at(self._due, self._probe)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        parse_s = self._parse_work()
        self.parse_s += parse_s
        self.observe(now - self._due, self._gil_wait(), now, parse_s / (now - self._due + PROBE_S))
        self._due = now + PROBE_S
        self._timer = loop.call_at(self._due, self._probe)
        self.enforce(time.monotonic())

    def observe(self, lag_s: float, gil_s: float, now: float, parse_share: float = 0.0) -> None:
        """One probe: the timer ran ``lag_s`` late, the engine's hand-offs waited ``gil_s``,
        text messages took ``parse_share`` of the loop's time since the last."""
        if gil_s > 0.0:
            self._gil_at = now
        elif now - self._gil_at < GIL_CARRY_S:  # no step since the last probe, the last was recent
            gil_s = self.gil_s
        self.lag_s, self.gil_s = lag_s, gil_s
        self.lag_sum += lag_s
        i = 0
        while i < len(LAG_BUCKETS) and lag_s > LAG_BUCKETS[i]:
            i += 1
        self.lag_buckets[i] += 1
        th = self.thresholds
        if not th.parse_share:
            parse_share = 0.0
        if lag_s > th.loop_lag_s or gil_s > th.gil_wait_s or parse_share > th.parse_share:
            self._hot += 1
            if not self.overloaded and self._hot >= th.sustain:
                self.overloaded = True
                self.episodes += 1
            self._calm_since = None
        elif self.overloaded:
            self._hot = 0
            if lag_s > th.loop_lag_s / 2 or gil_s > th.gil_wait_s / 2 or parse_share > th.parse_share / 2:
                self._calm_since = None
            elif self._calm_since is None:
                self._calm_since = now
            elif now - self._calm_since >= th.calm_s:
                self.overloaded = False
        else:
            self._hot = 0
        if self.overloaded and self._observed_at is not None:
            self.overloaded_s += max(0.0, now - self._observed_at)  # a late probe: the time that passed
        self._observed_at = now

    # ------------------------------------------------------------------ fair shares
    def key(self, host: str) -> str:
        """The client that ``host`` (the forwarded client behind a trusted proxy) is charged as."""
        return client_key(host, self.ipv6_prefix)

    def enforce(self, now: float) -> None:
        """At each probe: near the loop's capacity, close the costliest connections of the
        clients over their share, half of a client's at a time (at least one)."""
        share = self.loop_share
        requests = self._requests
        if requests is not None:  # the ceiling gives way while the loop lags, comes back once calm
            base = self.thresholds.http_requests_per_s
            if self.overloaded or self._hot > 0:
                requests.capacity = max(base * CEILING_MIN, requests.capacity * CEILING_CUT)
            else:
                requests.capacity = min(base, requests.capacity + base * CEILING_GROW)
        # With no ceiling on text handling (--overload-parse-share 0) only a sustained overload
        # presses: a client's text alone, however much, is then no one's concern.
        early = self._hot > 0 or share.total(now) > PRESSED * share.capacity
        self.pressed = self.overloaded or (bool(self.thresholds.parse_share) and early)
        if not self.pressed:
            return
        for client in share.over_clients(now, self._room()):
            self._blamed_at = now
            conns = self._conns.get(client)
            if not conns:
                continue
            for conn in sorted(conns, key=conns.__getitem__, reverse=True)[: max(1, len(conns) // 2)]:
                del conns[conn]
                self.cut["connection"] += 1
                conn.cut()
            if not conns:
                del self._conns[client]

    def _room(self) -> int:
        """Overloaded, a share is kept for one newcomer: one client spending all the loop can
        do is over its share then, though alone."""
        return int(self.overloaded)

    def blamed(self, now: float) -> bool:
        """Whether the overload is someone's: a client was over its share lately."""
        return now - self._blamed_at < BLAME_S

    def refuses(self, client: str, now: float) -> bool:
        """Whether ``client``'s work is refused now: the loop is pressed and it is over its share."""
        if self.pressed and self.loop_share.over(client, now, self._room()):
            self._blamed_at = now
            return True
        return False

    def charge(self, client: str, conn: Cuttable | None, seconds: float, now: float) -> None:
        """Charge ``seconds`` of the loop's time to ``client`` (and its connection ``conn``)."""
        self.loop_share.charge(client, seconds, now)
        if conn is not None:
            conns = self._conns.setdefault(client, {})
            conns[conn] = conns.get(conn, 0.0) + seconds

    def forget(self, client: str, conn: Cuttable) -> None:
        """``conn`` is gone: no longer one to cut."""
        conns = self._conns.get(client)
        if conns is not None:
            conns.pop(conn, None)
            if not conns:
                del self._conns[client]

    # ------------------------------------------------------------------ shedding
    def admit_request(self, path: bytes, client: str) -> str | None:
        """Why an HTTP request for ``path`` (its query cut off) from ``client`` (:meth:`key`) is
        refused, or None: serve it. ``"over_share"`` (429): the client is over its share of the
        loop or of the HTTP ceiling; ``"overloaded"`` (503): shed, no probe of the reserve left."""
        now = time.monotonic()
        if self.refuses(client, now):
            self.shed["http_request"] += 1
            self.cut["http_request"] += 1
            return "over_share"
        requests = self._requests
        if not self.overloaded or self.blamed(now):
            if requests is None or not requests.over(client, now):
                if requests is not None:
                    requests.charge(client, 1.0, now)
                self.loop_share.charge(client, HTTP_REQUEST_S, now)
                return None
            if self.overloaded or self._hot:  # over its share of the ceiling: the overload is its
                self._blamed_at = now
            if path not in PROBES:
                self.shed["http_request"] += 1
                self.cut["http_request"] += 1
                return "over_share"
        probes = self._probes
        if path in PROBES and not probes.over(client, now) and self._address_probes.take(client, now):
            probes.charge(client, 1.0, now)
            return None
        self.shed["http_request"] += 1
        return "overloaded"

    def admit_session(self, client: str | None = None) -> bool:
        """Whether a new session of ``client`` (:meth:`key`; None: unknown) may start now;
        False: refuse it (1013) before any work. Its upgrade is charged to it."""
        now = time.monotonic()
        key = client or ""
        if self.refuses(key, now):
            self.shed["session"] += 1
            self.cut["session"] += 1
            return False
        if self.overloaded and not self.blamed(now):
            self.shed["session"] += 1
            return False
        self.loop_share.charge(key, UPGRADE_S, now)
        return True


class OverloadCollector(Collector):
    def __init__(self, manager: OverloadManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        m = self.manager
        yield GaugeMetricFamily(
            "duplexserve_overloaded",
            "1 while the server sheds work that is not live audio",
            int(m.overloaded),
        )
        yield GaugeMetricFamily("duplexserve_loop_lag_seconds_last", "the latest probe's loop lag", m.lag_s)
        cumulative, total = [], 0
        for count in m.lag_buckets:
            total += count
            cumulative.append(total)
        bounds = [*(str(b) for b in LAG_BUCKETS), "+Inf"]
        yield HistogramMetricFamily(
            "duplexserve_loop_lag_seconds",
            f"how late a timer due every {PROBE_S} s ran on the event loop",
            buckets=list(zip(bounds, cumulative, strict=True)), sum_value=m.lag_sum,
        )  # fmt: skip
        yield CounterMetricFamily(
            "duplexserve_overload_episodes", "times the server became overloaded", value=m.episodes
        )
        yield CounterMetricFamily(
            "duplexserve_text_handling_seconds",
            "the event loop's time handling WebSocket text (JSON) messages, all connections",
            value=m.parse_s,
        )
        yield CounterMetricFamily(
            "duplexserve_overload_seconds", "time spent overloaded", value=m.overloaded_s
        )
        shed = CounterMetricFamily(
            "duplexserve_overload_shed",
            "work refused while overloaded or over the HTTP ceiling",
            labels=["work"],
        )
        for work in SHED_WORK:
            shed.add_metric([work], m.shed[work])
        yield shed
        cut = CounterMetricFamily(
            "duplexserve_fair_share_cut",
            "work of clients over their fair share refused or closed (connections) near the loop's capacity",
            labels=["work"],
        )
        for work in CUT_WORK:
            cut.add_metric([work], m.cut[work])
        yield cut
        yield GaugeMetricFamily(
            "duplexserve_fair_share_clients", "clients charged the loop's time lately",
            m.loop_share.active(time.monotonic()),
        )  # fmt: skip
