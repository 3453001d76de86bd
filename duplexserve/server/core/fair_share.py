"""A fair share of one resource among clients: per-client cost with decay, the share, who is over.

Every session shares one event loop, and global figures (the HTTP ceiling, the probes'
reserve, the loop's time for work that is not audio) were first come, first served: 30
addresses each under its own budget filled the HTTP ceiling, and one key holder's
connections, each under its parse budget, made the overload manager refuse every honest
newcomer (issue 73). So each global figure is shared: a client may use at most
``capacity / active clients`` of it (never less than ``floor``), and only those over their
share are refused or cut. Sans-I/O: the caller passes the time; the overload manager
(server/overload.py) and the budgets consult it.

A client's cost is an exponentially decaying sum (time constant ``tau_s``): its value over
``tau_s`` is the client's recent rate, in the resource's unit a second. A client counts as
active while that rate is above :data:`IDLE` of the share's floor. The map holds at most
:data:`MAX_CLIENTS` (past it, the idle are forgotten, else the cheapest eighth at once: a
flood of new addresses costs one scan in thousands of charges), and the active count and the total
are recomputed at most every :data:`REFRESH_S` (between, a new client and a charge are added
as they come), not per charge.
"""

from __future__ import annotations

import math

#: Clients with a cost at most; past it, the smallest are forgotten first.
MAX_CLIENTS = 16384
#: How often the active count and the total are recomputed (a scan of the map).
REFRESH_S = 0.1
#: A client whose rate is under this fraction of the floor is idle: not counted, forgotten.
IDLE = 0.05


class FairShare:
    """What each client spent of one resource lately, and whether it is over its share."""

    __slots__ = ("_active", "_costs", "_refreshed", "_total", "capacity", "floor", "tau_s")

    def __init__(self, capacity: float, floor: float, tau_s: float = 1.0) -> None:
        self.capacity, self.floor, self.tau_s = capacity, floor, tau_s
        self._costs: dict[str, tuple[float, float]] = {}  # client: (decayed sum, when)
        self._refreshed = -math.inf
        self._active = 0
        self._total = 0.0

    def _decayed(self, client: str, now: float) -> float:
        value, at = self._costs.get(client, (0.0, now))
        return value * math.exp(-(now - at) / self.tau_s) if now > at else value

    def charge(self, client: str, cost: float, now: float) -> None:
        """Add ``cost`` to ``client``'s."""
        if client not in self._costs:
            if len(self._costs) >= MAX_CLIENTS:
                self._forget(now)
            self._active += 1  # counted at once, not at the next recount
        self._total += cost / self.tau_s
        self._costs[client] = (self._decayed(client, now) + cost, now)

    def rate(self, client: str, now: float) -> float:
        """``client``'s recent rate, in the resource's unit a second."""
        return self._decayed(client, now) / self.tau_s

    def _refresh(self, now: float) -> None:
        if now - self._refreshed < REFRESH_S:
            return
        self._refreshed = now
        idle = self.floor * IDLE * self.tau_s
        active, total, gone = 0, 0.0, []
        for client in self._costs:
            value = self._decayed(client, now)
            if value < idle:
                gone.append(client)
            else:
                active += 1
                total += value
        for client in gone:
            del self._costs[client]
        self._active, self._total = active, total / self.tau_s

    def active(self, now: float) -> int:
        """Clients that spent of the resource lately."""
        self._refresh(now)
        return self._active

    def total(self, now: float) -> float:
        """All clients' recent rate together (as of the latest recount)."""
        self._refresh(now)
        return self._total

    def share(self, now: float, room: int = 0) -> float:
        """What one client may spend a second: the capacity over the active clients (and
        ``room`` newcomers more), at least the floor."""
        return max(self.floor, self.capacity / max(1, self.active(now) + room))

    def over(self, client: str, now: float, room: int = 0) -> bool:
        """Whether ``client`` spends more than its share."""
        return client in self._costs and self.rate(client, now) > self.share(now, room)

    def over_clients(self, now: float, room: int = 0) -> list[str]:
        """The clients over their share, the costliest first."""
        share = self.share(now, room)
        rates = [(self.rate(c, now), c) for c in self._costs]
        return [c for r, c in sorted(rates, reverse=True) if r > share]

    def _forget(self, now: float) -> None:
        self._refreshed = -math.inf
        self._refresh(now)
        if len(self._costs) >= MAX_CLIENTS:  # every one is active: the cheapest eighth go at once
            cheapest = sorted(self._costs, key=lambda c: self._decayed(c, now))[: MAX_CLIENTS // 8]
            for client in cheapest:
                del self._costs[client]
            self._active -= len(cheapest)
