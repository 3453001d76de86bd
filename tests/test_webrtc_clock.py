"""The WebRTC calls' shared play clock (server/transports/webrtc/clock.py), on a fake loop."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from duplexserve.server.transports.webrtc.clock import MAX_CATCH_UP, PlayClock


class Handle:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    def __init__(self) -> None:
        self.now = 100.0
        self.timers: list[Handle] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> Handle:
        handle = Handle(when, callback)
        self.timers.append(handle)
        return handle

    def run_until(self, until: float) -> None:
        """Fire the timers due by ``until`` in time order, the clock at each one's time."""
        while True:
            live = [t for t in self.timers if not t.cancelled and t.when <= until]
            if not live:
                break
            timer = min(live, key=lambda t: t.when)
            self.timers.remove(timer)
            self.now = max(self.now, timer.when)
            timer.callback()
        self.now = until

    @property
    def armed(self) -> int:
        return sum(not t.cancelled for t in self.timers)


def test_calls_play_every_80_ms_from_the_next_phase_at_or_after_their_due_time() -> None:
    loop = FakeLoop()
    clock = PlayClock(loop)
    played: dict[str, list[float]] = {"a": [], "b": [], "c": []}
    first_a = clock.join("a", 100.0, lambda _: played["a"].append(loop.now))
    first_b = clock.join("b", 100.013, lambda _: played["b"].append(loop.now))  # between phases: the next
    first_c = clock.join("c", 100.041, lambda _: played["c"].append(loop.now))
    assert first_a == 100.0 and first_b == pytest.approx(100.02) and first_c == pytest.approx(100.05)
    loop.run_until(100.33)
    assert played["a"] == pytest.approx([100.0, 100.08, 100.16, 100.24, 100.32])
    assert played["b"] == pytest.approx([100.02, 100.10, 100.18, 100.26])
    assert played["c"] == pytest.approx([100.05, 100.13, 100.21, 100.29])


def test_calls_of_one_phase_play_in_one_callback() -> None:
    loop = FakeLoop()
    clock = PlayClock(loop)
    ticks: list[tuple[float, str]] = []
    clock.join("first", 100.0, lambda _: None)  # sets the phases
    for name, due in (("x", 100.031), ("y", 100.039), ("z", 100.040)):
        clock.join(name, due, lambda _, name=name: ticks.append((loop.now, name)))
    loop.run_until(100.05)
    assert ticks == [(pytest.approx(100.04), "x"), (pytest.approx(100.04), "y"), (pytest.approx(100.04), "z")]


def test_a_call_never_plays_before_its_first_due_time() -> None:
    loop = FakeLoop()
    clock = PlayClock(loop)
    clock.join("first", 100.0, lambda _: None)
    loop.run_until(100.5)
    late: list[float] = []
    # Due at 100.75: its phase (slot 3 of 8) came round at 100.66 already; the first play is 100.74.
    assert clock.join("late", 100.735, lambda _: late.append(loop.now)) == pytest.approx(100.74)
    loop.run_until(100.85)
    assert late == pytest.approx([100.74, 100.82])


def test_leaving_stops_the_calls_and_the_timer_with_the_last() -> None:
    loop = FakeLoop()
    clock = PlayClock(loop)
    played: list[str] = []
    clock.join("a", 100.0, lambda _: played.append("a"))
    clock.join("b", 100.0, lambda _: (played.append("b"), clock.leave("b")))  # leaves while playing
    loop.run_until(100.2)
    assert played.count("b") == 1 and played.count("a") == 3 and len(clock) == 1
    clock.leave("a")
    assert len(clock) == 0 and loop.armed == 0
    loop.run_until(101.0)
    assert played.count("a") == 3
    # Idle, the next call sets the phases afresh.
    assert clock.join("c", 101.003, lambda _: None) == pytest.approx(101.003)


def test_a_loop_that_stood_still_catches_up_a_few_frames_then_starts_again_from_now() -> None:
    loop = FakeLoop()
    clock = PlayClock(loop)
    played: list[float] = []
    backlogs: list[int] = []  # each play says how many of its own follow at once
    clock.join("a", 100.0, lambda backlog: (played.append(loop.now), backlogs.append(backlog)))
    loop.run_until(100.0)
    loop.now = 100.3  # 300 ms late: the frames due at 100.08 .. 100.24 play at once
    loop.run_until(100.3)
    assert len(played) == 1 + 3 and set(played[1:]) == {100.3}
    assert backlogs == [0, 2, 1, 0]
    loop.now = 102.01  # 1.7 s late: MAX_CATCH_UP frames at once, the rest skipped, then the grid
    loop.run_until(102.01)
    assert len(played) == 4 + MAX_CATCH_UP and set(played[4:]) == {102.01}
    assert backlogs[4:] == list(range(MAX_CATCH_UP - 1, -1, -1))
    loop.run_until(102.1)
    assert played[4 + MAX_CATCH_UP :] == pytest.approx([102.08]) and backlogs[-1] == 0
