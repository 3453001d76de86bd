"""Token buckets: one per budget, and one per client address, bounded in number."""

from __future__ import annotations

import ipaddress

from duplexserve.server.core.client_address import client_key, parse_ip

#: Addresses with a bucket at most; past it, full buckets (nothing owed) are forgotten first.
MAX_ADDRESSES = 16384


class Bucket:
    """A token bucket of ``rate`` a second and ``rate * burst_s`` deep, full at the start."""

    __slots__ = ("_at", "cap", "level", "rate")

    def __init__(self, rate: float, burst_s: float, now: float) -> None:
        self.rate, self.cap = rate, rate * burst_s
        self.level, self._at = self.cap, now

    def has(self, now: float, cost: float = 1.0) -> bool:
        """Whether the bucket, refilled for the time since the last look, holds ``cost``."""
        self.level = min(self.cap, self.level + (now - self._at) * self.rate)
        self._at = now
        return self.level >= cost

    def take(self, now: float, cost: float = 1.0) -> bool:
        """Spend ``cost`` if the bucket holds it."""
        if not self.has(now, cost):
            return False
        self.level -= cost
        return True

    def full(self, now: float) -> bool:
        return self.level + (now - self._at) * self.rate >= self.cap


class AddressBuckets:
    """One :class:`Bucket` per address, bounded in number (an attacker with many addresses
    makes the map forget idle ones, never grow past :data:`MAX_ADDRESSES`)."""

    def __init__(self, rate: float, burst_s: float) -> None:
        self.rate, self.burst_s = rate, burst_s
        self._buckets: dict[str, Bucket] = {}

    def take(self, address: str, now: float, cost: float = 1.0) -> bool:
        """Spend ``cost`` of ``address``'s bucket if it holds it (a new address's is full)."""
        bucket = self._buckets.get(address)
        if bucket is None:
            if len(self._buckets) >= MAX_ADDRESSES:
                self._forget(now)
            bucket = self._buckets[address] = Bucket(self.rate, self.burst_s, now)
        return bucket.take(now, cost)

    def spent(self, address: str, now: float) -> bool:
        """Whether ``address`` has nothing left for even one request."""
        bucket = self._buckets.get(address)
        return bucket is not None and not bucket.has(now)

    def has(self, address: str, now: float, cost: float = 1.0) -> bool:
        """Whether ``address``'s bucket holds ``cost`` (a new address's would)."""
        bucket = self._buckets.get(address)
        return bucket is None or bucket.has(now, cost)

    def _forget(self, now: float) -> None:
        buckets = self._buckets
        for address in [a for a, b in buckets.items() if b.full(now)]:
            del buckets[address]
        while len(buckets) >= MAX_ADDRESSES:  # every one owes: the oldest go
            del buckets[next(iter(buckets))]


def address_key(client: tuple[str, int] | None, proxies: list[str], ipv6_prefix: int) -> str | None:
    """The client a connection is counted as, by every per-connection count (the HTTP, upgrade
    and parse budgets, the connection caps): the peer's address as the session quotas count
    it (``client_key``: IPv6 by its ``--client-ipv6-prefix`` network), or None for a trusted
    proxy (``*`` trusts every peer) or a peer with no address. One function, so that no count
    keys clients another way (issue 73: the prefix never reached the HTTP budgets)."""
    if client is None or "*" in proxies:
        return None
    ip = parse_ip(client[0])
    if ip is None:  # a Unix socket's peer
        return None
    if any(ip in ipaddress.ip_network(p, strict=False) for p in proxies):
        return None
    return client_key(client[0], ipv6_prefix)
