"""Fair shares (issue 73), sans I/O with a fake clock: the share, who is over, the overload
manager's decisions, and its overload counter under a lagging loop."""

from __future__ import annotations

import time

from duplexserve.server.core.fair_share import FairShare
from duplexserve.server.overload import OverloadManager, Thresholds


def test_the_share_is_the_capacity_over_the_active_clients_and_only_the_heavy_are_over():
    share = FairShare(capacity=100.0, floor=2.0)
    for t in range(20):  # 30 clients at 10 a second each, one at 1 a second
        now = t * 0.1
        for c in range(30):
            share.charge(f"10.0.0.{c}", 1.0, now)
        if t % 10 == 0:
            share.charge("honest", 1.0, now)
    now = 2.0
    assert share.active(now) == 31
    assert abs(share.share(now) - 100 / 31) < 1e-9
    assert share.over("10.0.0.1", now) and not share.over("honest", now)
    assert not share.over("newcomer", now)
    assert share.over_clients(now)[0].startswith("10.0.0.")


def test_the_overload_counter_adds_the_time_that_passed_between_late_probes():
    """A loop lagging a second at each probe: the counter grows by the seconds that passed,
    not 50 ms a probe (before: 0.05 s per probe, 11 s of overload counted as 0.55 s)."""
    manager = OverloadManager(Thresholds(), lambda: 0.0, lambda: 0.0)
    for t in range(14):
        manager.observe(1.0, 0.0, float(t))
    assert manager.overloaded
    # overloaded at the 4th probe (t = 3), counting the period it ends: 11 s to t = 13
    assert abs(manager.overloaded_s - 11.0) < 1e-6


class _Conn:
    def __init__(self) -> None:
        self.cut_count = 0

    def cut(self) -> None:
        self.cut_count += 1


def test_near_capacity_the_heavy_clients_connections_are_cut_and_a_newcomer_admitted():
    """One client's 40 connections spending the loop: at the next probe its costliest are
    closed, its requests get 429 and its sessions 1013, while a newcomer's session, /v1/models
    and /health are served though the loop is overloaded (before: every newcomer refused)."""
    manager = OverloadManager(Thresholds(), lambda: 0.0, lambda: 0.0)
    now = time.monotonic()
    conns = [_Conn() for _ in range(40)]
    for conn in conns:
        manager.charge("203.0.113.9", conn, 0.025, now)
    manager.charge("198.51.100.1", None, 0.001, now)  # an honest session's control events
    for t in range(5):  # the loop lags: overloaded
        manager.observe(0.2, 0.0, now + t * 0.05)
    assert manager.overloaded
    manager.enforce(now)
    assert sum(c.cut_count for c in conns) == 20
    assert manager.admit_session("192.0.2.7")  # a newcomer
    assert manager.admit_session("198.51.100.1")
    assert not manager.admit_session("203.0.113.9")
    assert manager.admit_request(b"/v1/models", "192.0.2.7") is None
    assert manager.admit_request(b"/health", "192.0.2.7") is None
    assert manager.admit_request(b"/v1/models", "203.0.113.9") == "over_share"
    assert manager.cut["connection"] == 20 and manager.cut["session"] == 1


def test_an_overload_no_client_causes_still_sheds_everyone():
    """The engine's GIL waits, no client over its share: new sessions and requests are shed,
    probes served from the reserve, as before."""
    manager = OverloadManager(Thresholds(), lambda: 0.0, lambda: 0.0)
    now = time.monotonic()
    for t in range(5):
        manager.observe(0.0, 1.0, now + t * 0.05)
    manager.enforce(now)
    assert not manager.admit_session("192.0.2.7")
    assert manager.admit_request(b"/v1/models", "192.0.2.7") == "overloaded"
    assert manager.admit_request(b"/health", "192.0.2.7") is None


def test_many_clients_cannot_fill_the_http_ceiling_nor_the_probe_reserve():
    """30 clients at 50 requests a second, each under a per-address budget of 200, fill the
    1,000 a second ceiling: an honest client's requests are still served, and each heavy
    one gets about its share (before: the first come took the whole ceiling)."""
    manager = OverloadManager(Thresholds(), lambda: 0.0, lambda: 0.0)
    start = time.monotonic()
    served: dict[str, int] = {}
    honest = []
    # the manager reads its own clock: 2 s of traffic squeezed into as fast as this runs
    for step in range(100):
        for c in range(30):
            client = f"10.1.0.{c}"
            for _ in range(2):
                if manager.admit_request(b"/v1/models", client) is None:
                    served[client] = served.get(client, 0) + 1
        if step % 10 == 0:
            honest.append(manager.admit_request(b"/v1/models", "192.0.2.50"))
            honest.append(manager.admit_request(b"/health", "192.0.2.50"))
    elapsed = time.monotonic() - start
    assert honest == [None] * len(honest)
    assert sum(served.values()) < 6000  # refused: every heavy client is over its share
    assert manager.cut["http_request"] > 0
    print(f"{elapsed:.2f} s; served {sum(served.values())} of 6000 flood requests")


def test_the_map_of_clients_stays_bounded_under_a_flood_of_new_addresses():
    from duplexserve.server.core import fair_share

    share = FairShare(capacity=100.0, floor=2.0)
    for c in range(fair_share.MAX_CLIENTS + 100):
        share.charge(f"2001:db8:{c:x}::/64", 1.0, 0.0)
    assert len(share._costs) <= fair_share.MAX_CLIENTS
    assert share.active(0.0) == len(share._costs)
