"""One play clock for every WebRTC call of a server, the calls grouped into a few phases.

Each call plays one 80 ms frame of its jitter buffer every 80 ms, from shortly after its
first packet. On clocks of their own the calls tick at scattered moments, and every
frame then crosses to the engine thread alone: its own queue put and wake-up, an engine
step for one session, its own hand-back and loop wake-up. Measured on the 2-core machine
with 20 paced sessions of the native protocol, that is 660-740 us of server CPU a frame
against 280-350 us when the frames arrive together (docs/benchmarks.md, WebRTC). Here a
call's frames are due on the first of ``slots`` phases of the frame at or after its own
first due time (10 ms apart: at most 10 ms later), and the calls of one phase play in one
callback, so their frames reach the engine as one batch.

No I/O: the loop is only asked for its time and for ``call_at``, so the tests drive it
with a fake one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

FRAME_S = 0.08
SLOTS = 8  # phases a frame: 10 ms apart
#: Frames the clock plays at once to catch up after the loop stood still; further behind,
#: it starts again from now (the frames in between are not played).
MAX_CATCH_UP = 5


class Loop(Protocol):
    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], None]) -> Any: ...


class PlayClock:
    def __init__(self, loop: Loop, frame_s: float = FRAME_S, slots: int = SLOTS) -> None:
        self._loop = loop
        self._slots = slots
        self._step = frame_s / slots
        self._members: list[dict[object, tuple[int, Callable[[int], None]]]] = [{} for _ in range(slots)]
        self._where: dict[object, int] = {}  # member -> its slot
        self._origin = 0.0
        self._next = 0  # the next tick to run, counted from the origin
        self._timer: Any = None

    def __len__(self) -> int:
        return len(self._where)

    def join(self, key: object, not_before: float, play: Callable[[int], None]) -> float:
        """``play(backlog)`` once a frame from the first tick at or after ``not_before``;
        returns that tick's time. ``backlog``: the plays of this member that follow at once
        (catching up after the loop stood still), so that what they will play is not taken
        for a sender running ahead. ``key`` names the member for :meth:`leave`."""
        self.leave(key)
        if not self._where and self._timer is None:  # idle: the first member sets the phases
            self._origin, self._next = not_before, 0
        start = max(self._next, math.ceil((not_before - self._origin) / self._step - 1e-9))
        slot = start % self._slots
        self._members[slot][key] = (start, play)
        self._where[key] = slot
        self._arm()
        return self._origin + start * self._step

    def leave(self, key: object) -> None:
        slot = self._where.pop(key, None)
        if slot is not None:
            del self._members[slot][key]
        if not self._where and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        if self._timer is None and self._where:
            self._timer = self._loop.call_at(self._origin + self._next * self._step, self._tick)

    def _tick(self) -> None:
        self._timer = None
        now, slots = self._loop.time(), self._slots
        due = math.floor((now - self._origin) / self._step + 1e-9)  # the last tick due by now
        last = min(due, self._next + MAX_CATCH_UP * slots - 1)
        while self._next <= last:
            tick = self._next
            self._next += 1
            for start, play in list(self._members[tick % slots].values()):
                if start <= tick:
                    play((last - tick) // slots)
        if due >= self._next:  # the loop stood still for long
            self._next = math.ceil((now - self._origin) / self._step)
        self._arm()
