"""How many connections the server holds: in all, and per client, below the descriptor limit.

Every connection is a file descriptor. Past ``RLIMIT_NOFILE`` accept() fails and the server
answers no one, /health included: 1,008 connections from one address held open did it under a
limit of 1,024 (issue 73). So the connections are counted as they are made:

- in all, at most the descriptor limit less a reserve (:func:`connection_caps`: an eighth of
  it, at least :data:`MIN_RESERVE`) for the engine, its pipes, logs and the WebRTC sockets;
- per client (:func:`~duplexserve.server.core.token_buckets.address_key`: IPv6 by
  ``--client-ipv6-prefix``; a proxy of ``--forwarded-allow-ips`` and loopback, this host, count
  in all only), ``--max-connections-per-client``, by default an eighth of the total (so eight
  clients at their cap still leave room) and at most :data:`MAX_PER_CLIENT`.

``duplexserve_connections_open`` is how many are held now, ``duplexserve_connections_cap{scope}``
the caps (``total``, ``per_client``). A connection past a cap is closed as it is made, before
anything is read, and counted
(``duplexserve_connections_over_budget_total{budget="connections_per_client"|"connections"}``).
The new one is closed, not the client's oldest: every held connection is already bounded in
time (a request head by the head deadline, an idle keep-alive by uvicorn's keep-alive timeout,
a WebSocket by its session's idle timeout), so the cap frees within seconds, and an attacker
could keep its connections looking busy where a NAT's honest ones would be the "oldest idle".
"""

from __future__ import annotations

import ipaddress
import logging
import resource
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("duplexserve")

#: Descriptors kept out of the connections' reach, at least.
MIN_RESERVE = 64
#: The automatic per-client cap at most (a NAT of many users may need ``--max-connections-per-client``).
MAX_PER_CLIENT = 1024


@dataclass(frozen=True, slots=True)
class ConnectionCaps:
    """Connections held at once: in all and per client (0: no limit)."""

    total: int
    per_client: int


def descriptor_limit() -> int:
    """The soft ``RLIMIT_NOFILE``: the descriptors this process may hold (the operator's to
    raise, ``ulimit -n`` or systemd's ``LimitNOFILE``; Docker's default is 1,048,576)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_caps(limit: int, per_client: int = -1) -> ConnectionCaps:
    """The caps under a descriptor ``limit``; ``per_client`` -1: automatic, 0: none."""
    total = max(1, limit - max(MIN_RESERVE, limit // 8))
    if per_client < 0:
        per_client = max(1, min(MAX_PER_CLIENT, total // 8))
    return ConnectionCaps(total, per_client)


def counts_per_client(key: str | None) -> bool:
    """Whether a connection of ``key`` (an :func:`address_key`) has a per-client count:
    not a trusted proxy's (None), not this host's (loopback)."""
    return key is not None and not ipaddress.ip_network(key, strict=False).is_loopback


class Connections:
    """The connections held now, in all and per client key."""

    def __init__(self, caps: ConnectionCaps) -> None:
        self.caps = caps
        self.open = 0
        self._per_client: Counter[str] = Counter()

    def admit(self, key: str | None) -> str | None:
        """Count a new connection of ``key``; or the cap it would go over (not counted)."""
        caps = self.caps
        if caps.total and self.open >= caps.total:
            return "connections"
        per_client = key is not None and caps.per_client > 0 and counts_per_client(key)
        if per_client and self._per_client[key] >= caps.per_client:  # type: ignore[index]
            return "connections_per_client"
        self.open += 1
        if per_client:
            self._per_client[key] += 1  # type: ignore[index]
        return None

    def release(self, key: str | None) -> None:
        """A connection :meth:`admit` counted is gone."""
        self.open -= 1
        if key is not None and key in self._per_client:
            left = self._per_client[key] - 1
            if left > 0:
                self._per_client[key] = left
            else:
                del self._per_client[key]


class ConnectionsCollector(Collector):
    """``/metrics``: the connections held now and the caps."""

    def __init__(self, connections: Connections) -> None:
        self.connections = connections

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held = self.connections.open
        yield GaugeMetricFamily("duplexserve_connections_open", "TCP connections held now", held)
        caps = GaugeMetricFamily(
            "duplexserve_connections_cap", "connections held at once at most (0: no limit)", labels=["scope"]
        )
        caps.add_metric(["total"], self.connections.caps.total)
        caps.add_metric(["per_client"], self.connections.caps.per_client)
        yield caps
