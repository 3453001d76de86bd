"""Who a client is, for the per-client quotas: the address that counts, and which proxies may name it.

An address string is not a client. IPv6 has many spellings of one address
(``2001:db8::1``, ``2001:DB8:0:0::1``, ``[2001:db8::1]``), a dual-stack socket writes an
IPv4 peer as ``::ffff:203.0.113.7``, and one IPv6 subscriber holds a whole /64 (RFC 6177):
each of its 2^64 addresses would otherwise be a client of its own. So the quotas count
:func:`client_key`: the IPv4 address, or the IPv6 network of ``--client-ipv6-prefix`` bits.

Behind proxies the client is named in ``X-Forwarded-For``, which anyone can write: each
proxy appends the address it saw, so only the entries that trusted proxies appended mean
anything. :class:`ForwardedFor` reads the chain from the right and takes the first entry
that is not itself a trusted proxy: the address the last trusted proxy saw. ``*`` trusts
any peer but no entry of the chain, so it counts the rightmost entry (what the peer
appended), never the client-written leftmost one that uvicorn's own reading takes.
"""

from __future__ import annotations

import ipaddress
from typing import Any, NamedTuple

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


#: The scope's key for the TCP peer where :meth:`ForwardedFor.rewrite` put the client a proxy named.
PEER = "duplexserve.peer"


class ClientAddress(NamedTuple):
    """A connection's client as the scope has it (:func:`client_of`)."""

    host: str
    #: This host's own connection: every hop in sight is loopback (the peer, the client counted
    #: and what a proxy says it saw last), where a loopback peer alone may be a proxy on this
    #: host passing on anyone's connections.
    local: bool


def client_of(scope: dict[str, Any]) -> ClientAddress | None:
    """The client of an ASGI scope (after :meth:`ForwardedFor.rewrite`), or None if it has none."""
    client = scope.get("client")
    if not client:
        return None
    local = is_loopback(scope.get(PEER, client)[0]) and is_loopback(client[0])
    if local:
        chain = b",".join(value for name, value in scope.get("headers", ()) if name == b"x-forwarded-for")
        local = not chain or is_loopback(_host_port(chain.decode("latin-1").rsplit(",", 1)[-1].strip())[0])
    return ClientAddress(client[0], local)


def parse_ip(host: str) -> IPAddress | None:
    """``host`` as an IP address, an IPv4-mapped IPv6 one as its IPv4 address; None if it is none."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def client_key(host: str, ipv6_prefix: int) -> str:
    """What the per-client quotas count for ``host``: an IPv4 address, the IPv6 network of
    ``ipv6_prefix`` bits holding it, or (no IP address: a Unix socket) the text as it is."""
    ip = parse_ip(host)
    if ip is None:
        return host
    if isinstance(ip, ipaddress.IPv6Address):  # int(): a zone (fe80::1%eth0) is no other client
        return str(ipaddress.IPv6Network((int(ip), ipv6_prefix), strict=False))
    return str(ip)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this host's loopback (127/8, ::1, ::ffff:127.0.0.1)."""
    ip = parse_ip(host)
    return ip is not None and ip.is_loopback


def _host_port(hop: str) -> tuple[str, int]:
    """One ``X-Forwarded-For`` entry: ``ip``, ``ipv4:port``, ``[ipv6]`` or ``[ipv6]:port``."""
    if hop.startswith("["):
        host, _, rest = hop[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif hop.count(":") == 1:
        host, _, port = hop.partition(":")
    else:
        host, port = hop, ""
    return host, int(port) if port.isdigit() and len(port) <= 5 else 0


class ForwardedFor:
    """``X-Forwarded-For`` and ``X-Forwarded-Proto`` from the proxies of ``--forwarded-allow-ips``.

    Rewrites the scope's ``client`` (and ``scheme``) as uvicorn's proxy headers did, for
    every part that reads them (the quotas, logs), but reading the chain as the module
    docstring says.
    """

    def __init__(self, proxies: list[str]) -> None:
        self.any_peer = "*" in proxies
        self.networks = [ipaddress.ip_network(p, strict=False) for p in proxies if p != "*"]

    def _trusted(self, host: str) -> bool:
        ip = parse_ip(host)
        return ip is not None and any(ip in network for network in self.networks)

    def rewrite(self, scope: dict[str, Any]) -> None:
        peer = scope.get("client")
        if not peer or not (self.any_peer or self._trusted(peer[0])):
            return
        chain: list[bytes] = []
        for name, value in scope["headers"]:
            if name == b"x-forwarded-for":
                chain.append(value)
            elif name == b"x-forwarded-proto":
                proto = value.decode("latin-1").strip()
                if proto in ("http", "https", "ws", "wss"):
                    scope["scheme"] = proto.replace("http", "ws") if scope["type"] == "websocket" else proto
        if chain:
            scope[PEER] = peer
            scope["client"] = self.client(b",".join(chain).decode("latin-1"), peer)

    def client(self, chain: str, peer: tuple[str, int]) -> tuple[str, int]:
        """The client that ``chain`` (a trusted ``peer``'s ``X-Forwarded-For``) names: the first
        entry from the right that is no trusted proxy; the farthest one if all are. An entry
        that is no IP address is nobody's: the trusted hop that passed it on counts."""
        named = peer
        for hop in reversed(chain.split(",")):
            host, port = _host_port(hop.strip())
            if parse_ip(host) is None:
                return named
            named = (host, port)
            if not self._trusted(host):
                return named
        return named
