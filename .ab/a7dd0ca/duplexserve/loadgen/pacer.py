"""Paced sending for every session of a worker from one timer, on an absolute schedule.

Message *k* of a session is due at ``start + k x message duration``, computed from
the start, never from the previous send, so a late tick never shifts what follows (no
drift). One ``loop.call_at`` serves all sessions: a heap holds each session's next due
time, and a tick sends everything due. A task per session sleeping 12.5 times a second
would cost the client more than the server spends per frame. How late each send left
(the client's own lag) is recorded: if it grows, the client is the bottleneck.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from array import array
from collections.abc import Callable

monotonic = time.monotonic

#: A session's send step: called with the time; returns False once it sent its last message.
SendNext = Callable[[float], bool]


class Pacer:
    def __init__(self, period_s: float) -> None:
        self.period = period_s
        self.loop = asyncio.get_running_loop()
        self.lag = array("f")  # seconds each message left after its due time
        self._heap: list[tuple[float, int, float, int, SendNext]] = []  # (due, tie, start, k, send)
        self._tie = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = float("inf")

    def add(self, start: float, send_next: SendNext) -> None:
        """Schedule a session whose first message is due at ``start`` (monotonic seconds)."""
        heapq.heappush(self._heap, (start, next(self._tie), start, 0, send_next))
        self._arm()

    def _arm(self) -> None:
        if not self._heap:
            return
        due = self._heap[0][0]
        if due >= self._timer_due and self._timer is not None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_due = due
        self._timer = self.loop.call_at(due, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._timer_due = float("inf")
        heap, lag, period = self._heap, self.lag, self.period
        now = monotonic()
        while heap and heap[0][0] <= now:
            due, tie, start, k, send_next = heapq.heappop(heap)
            if send_next(now):
                heapq.heappush(heap, (start + (k + 1) * period, tie, start, k + 1, send_next))
            lag.append(now - due)
            now = monotonic()
        self._arm()
