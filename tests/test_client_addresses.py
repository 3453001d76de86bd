"""Who counts as one client for the per-client limit (issue 67, item 6): addresses normalised
(IPv6 spellings, IPv4-mapped), IPv6 by its /64, the forwarded chain read from the right, and
the loopback exemption only for this host's own connections (docs/reliability.md).

Clients other than loopback are named by a trusted proxy's ``X-Forwarded-For`` (documentation
addresses, RFC 5737 and RFC 3849, as header text only: every packet stays on loopback).
"""

from __future__ import annotations

import asyncio
from typing import Any

from tests.conftest import ServerProcess
from tests.test_hostile_admission import echoed, opened, over_budget, refused, run

REFUSED = ("too_many_sessions", 1008)


async def outcomes(
    server: ServerProcess, named: list[str], source: str = "127.0.0.1"
) -> tuple[list[Any], list[Any]]:
    """Open one session per entry of ``named`` (an ``X-Forwarded-For``; "" for none), in turn:
    what each got ("created" or its refusal), and the open connections."""
    got, live = [], []
    for forwarded in named:
        ws, first = await opened(server, forwarded or None, source)
        if first["type"] == "session.created":
            got.append("created")
            live.append(ws)
        else:
            got.append(await refused(ws, first))
    return got, live


async def all_echo(live: list[Any]) -> bool:
    return all(await asyncio.gather(*(echoed(ws, seed=20 + i) for i, ws in enumerate(live))))


def test_one_address_written_many_ways_is_one_client(server_factory):
    """The finding: one IPv6 address written five ways got five sessions at limit 1. And a
    dual-stack socket writes an IPv4 client as ``::ffff:a.b.c.d``: the same client."""
    server = server_factory("--forwarded-allow-ips", "127.0.0.1", "--max-sessions-per-client", "1")
    spellings = ["2001:db8::1", "2001:0DB8:0000:0000:0000:0000:0000:0001", "2001:db8:0:0::1",
                 "[2001:db8::1]", "[2001:db8::0:1]:443"]  # fmt: skip
    mapped = ["::ffff:203.0.113.9", "203.0.113.9", "[::ffff:cb00:7109]:80"]

    async def scenario() -> tuple[list, list, bool]:
        six, live6 = await outcomes(server, spellings)
        four, live4 = await outcomes(server, mapped)
        return six, four, await all_echo(live6 + live4)

    six, four, exact = run(scenario())
    assert six == ["created"] + [REFUSED] * 4
    assert four == ["created"] + [REFUSED] * 2
    assert exact
    assert over_budget(server, "sessions_per_client") == 6


def test_an_ipv6_client_is_its_64_unless_configured(server_factory):
    """The finding: 300 addresses of one /64 got 254 sessions. By default a /64 is one client
    (here a quarter of 8 slots: 2); ``--client-ipv6-prefix 128`` counts each address."""
    same_64 = ["2001:db8:1:2::a", "2001:db8:1:2:ffff::b", "2001:db8:1:2:1234:5678:9abc:def0"]
    others = ["2001:db8:1:3::a", "2001:db8:1:3::b"]  # the next /64: another client

    async def scenario(server: ServerProcess) -> tuple[list, bool]:
        got, live = await outcomes(server, same_64 + others)
        return got, await all_echo(live)

    grouped = server_factory("--forwarded-allow-ips", "127.0.0.1", "--max-sessions", "8")
    by_64, exact = run(scenario(grouped))
    assert by_64 == ["created", "created", REFUSED, "created", "created"] and exact
    each = server_factory("--forwarded-allow-ips", "127.0.0.1", "--max-sessions", "8",
                          "--max-sessions-per-client", "1", "--client-ipv6-prefix", "128")  # fmt: skip
    by_address, exact = run(scenario(each))
    assert by_address == ["created"] * 5 and exact


def test_the_forwarded_chain_is_read_from_the_right(server_factory):
    """The finding: with ``--forwarded-allow-ips '*'`` the client-written leftmost entry counted,
    a new client per connection. Now ``*`` counts what the peer appended (the rightmost entry),
    and the proxies named are skipped from the right up to the first address that is none of them."""
    server = server_factory("--forwarded-allow-ips", "*,10.0.0.0/8", "--max-sessions-per-client", "1")

    async def scenario() -> tuple[list, list, bool]:
        # The client writes any address it likes; the proxy appends the one it saw: 198.51.100.7.
        spoofing, live_a = await outcomes(server, [f"203.0.113.{i}, 198.51.100.7" for i in range(1, 4)])
        chain, live_b = await outcomes(server, [
            "203.0.113.1, 198.51.100.8, 10.0.0.2",  # through two proxies: 198.51.100.8 is the client
            "203.0.113.2, 198.51.100.8, 10.1.2.3:8080",
            "198.51.100.9, 10.0.0.2",  # another client through the same proxies
            "garbage, 10.0.0.3",  # nobody's entry: the inner proxy 10.0.0.3 that passed it counts
            "10.0.0.3",
        ])  # fmt: skip
        return spoofing, chain, await all_echo(live_a + live_b)

    spoofing, chain, exact = run(scenario())
    assert spoofing == ["created", REFUSED, REFUSED]
    assert chain == ["created", REFUSED, "created", "created", REFUSED]
    assert exact


def test_loopback_is_exempt_only_for_this_hosts_own_connections(server_factory):
    """The finding: every loopback client (127/8, ::1) was exempt from the default limit, also a
    loopback proxy passing on anyone's connections and a loopback address named by proxies far
    away. Now only this host's own connections are: every hop in sight loopback."""
    server = server_factory("--forwarded-allow-ips", "127.0.0.1,10.0.0.0/8", "--max-sessions", "16")  # 4 each

    async def scenario() -> tuple[list, list, list, bool]:
        # A proxy on 127.0.0.2, not named, passing on the internet: one client, 127.0.0.2.
        internet = [f"203.0.113.{i}" for i in range(1, 6)]
        passed_on, live_a = await outcomes(server, internet, source="127.0.0.2")
        # Loopback as the proxies at 10.0.0.2 saw it: the host of that proxy, not this one.
        far, live_b = await outcomes(server, ["127.0.0.1, 10.0.0.2"] * 5)
        # This host, directly (a benchmark, a probe) and through the proxy on it: no limit.
        direct, live_c = await outcomes(server, [""] * 5, source="127.0.0.3")
        proxied, live_d = await outcomes(server, ["127.0.0.1"], source="127.0.0.1")
        return passed_on, far, direct + proxied, await all_echo(live_a + live_b + live_c + live_d)

    passed_on, far, own, exact = run(scenario())
    assert passed_on == ["created"] * 4 + [REFUSED]
    assert far == ["created"] * 4 + [REFUSED]
    assert own == ["created"] * 6 and exact
    assert over_budget(server, "sessions_per_client") == 2
