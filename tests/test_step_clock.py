"""The engine's step clock (``batcher.StepClock``), gathering (``batcher.Gather``) and the
schedule they read, in simulated time.

What it must do: one step per frame period serving every session (not cohorts stepped
apart), a wait per session that stays the same for the whole session whoever joins, and
a quick catch-up after a slow step. The simulation drives the real batcher and clock the
way the bridge's engine thread does (decide, sleep or step), with time as a number.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from duplexserve.engine_bridge.batcher import CREEP_S, SLACK_S, FifoBatcher, Gather, SlotBatcher, StepClock

P = 0.08
FRAME = np.zeros(4, np.float32)


def test_schedule_spaces_the_frames_of_one_message_a_frame_apart():
    b = SlotBatcher(2, window=8, frame_s=P)
    b.open(0, 1)
    b.push(0, 1, FRAME, 10.0)
    b.push(0, 1, FRAME, 10.0)  # the same message: the same arrival
    assert b.oldest_due() == 10.0
    b.gather()
    assert math.isclose(b.oldest_due(), 10.08)


def test_a_late_message_keeps_its_place_and_a_paused_sender_gets_a_new_schedule():
    b = SlotBatcher(1, window=8, frame_s=P)
    b.open(0, 1)
    for k in range(3):
        b.push(0, 1, FRAME, 10.0 + k * P)
        b.gather()
    b.push(0, 1, FRAME, 10.0 + 3 * P + 0.005)  # 5 ms late: still due on the schedule
    assert abs(b.oldest_due() - (10.0 + 3 * P)) <= CREEP_S + 1e-9
    b.gather()
    b.push(0, 1, FRAME, 10.0 + 4 * P + 0.5)  # half a second late: the sender paused
    assert math.isclose(b.oldest_due(), 10.0 + 4 * P + 0.5)


def test_a_burst_sender_falls_due_one_frame_at_a_time():
    b = SlotBatcher(1, window=8, frame_s=P)
    b.open(0, 1)
    for _ in range(4):
        b.push(0, 1, FRAME, 5.0)
    dues = []
    for _ in range(4):
        dues.append(b.oldest_due())
        b.gather()
    assert np.allclose(dues, [5.0, 5.08, 5.16, 5.24])


def test_gather_takes_only_frames_due_by_the_cutoff():
    b = SlotBatcher(3, window=4, frame_s=P)
    for slot in range(3):
        b.open(slot, slot)
        b.push(slot, slot, np.full(4, slot, np.float32), 1.0 + 0.03 * slot)
    slots, gens, batch = b.gather(1.04)
    assert gens.tolist() == [0, 1]
    assert slots.tolist() == [0, 1] and batch[:, 0].tolist() == [0, 1]
    assert b.gather(0.5)[0].tolist() == [] and b.pending == 1


def test_a_frame_that_came_after_its_tick_is_caught_up_and_its_lateness_reported():
    b = SlotBatcher(2, window=4, frame_s=P)
    clock = StepClock(P)
    frame = np.zeros(4, np.float32)
    for slot in range(2):
        b.open(slot, slot)
        b.push(slot, slot, frame, 1.0)  # frame 0 of both: due at 1.0
    assert clock.decide(1.02, b.oldest_due()) == (0.0, 1.02 - SLACK_S) and not clock.catch_up
    assert b.gather(1.02 - SLACK_S)[0].tolist() == [0, 1] and b.arrived_past_due == 0.0
    b.push(0, 0, frame, 1.08)  # slot 0's frame 1: due at 1.08, on time
    wait, cutoff = clock.decide(1.10, b.oldest_due())  # the next tick
    assert wait == 0.0 and not clock.catch_up and b.gather(cutoff)[0].tolist() == [0]
    b.push(1, 1, frame, 1.125)  # slot 1's frame 1: due at 1.08, came after that tick
    wait, cutoff = clock.decide(1.13, b.oldest_due())
    assert wait == 0.0 and clock.catch_up and cutoff == 1.10 - SLACK_S
    assert b.gather(cutoff)[0].tolist() == [1] and abs(b.arrived_past_due - 0.045) < 1e-3
    wait, _ = clock.decide(1.14, b.oldest_due())  # nothing overdue: wait for the tick at 1.18
    assert abs(wait - 0.04) < 1e-9


def simulate(
    tick_s: float,
    sessions: int = 48,
    seconds: float = 20.0,
    step_s=lambda n: 0.025 + 0.0002 * n,
    jitter_s: float = 0.004,
    slow_step_at: float | None = None,
    seed: int = 0,
    gather: bool = False,
) -> tuple[float, dict[int, list[tuple[int, float]]]]:
    """Paced sessions (160 ms messages of two frames, random phases, arrivals late by up
    to ``jitter_s``, starts spread over the first second) against a step costing
    ``step_s(batch)``. Returns the steps per frame period and, per session, (frame, latency from the
    message's arrival to the end of the step that answered it) in order."""
    rng = random.Random(seed)
    # the bridge's batchers: on the clock or gathering, or at once
    b = SlotBatcher(sessions, window=16, frame_s=P) if tick_s or gather else FifoBatcher(sessions, window=16)
    clock = StepClock(tick_s) if tick_s else None
    gathering = Gather(P) if gather else None
    arrivals = []
    for s in range(sessions):
        b.open(s, s)
        start = rng.uniform(0.0, 1.0)
        for m in range(int(seconds / (2 * P))):
            arrivals.append((start + m * 2 * P + rng.uniform(0.0, jitter_s), s, m))
    arrivals.sort()
    sent: dict[tuple[int, int], float] = {}
    answered: dict[int, list[tuple[int, float]]] = {s: [] for s in range(sessions)}
    counter = [0] * sessions
    t, i, steps, slow_done = 0.0, 0, 0, False
    while i < len(arrivals) or b.pending:
        while i < len(arrivals) and arrivals[i][0] <= t:
            at, s, m = arrivals[i]
            for j in range(2):
                b.push(s, s, np.full(4, 2 * m + j, np.float32), at)
                sent[(s, 2 * m + j)] = at
            i += 1
        if not b.pending:
            t = arrivals[i][0]
            continue
        cutoff = math.inf
        if clock is not None:
            wait, cutoff = clock.decide(t, b.oldest_due())
            if wait > 0:
                t = min(t + wait, arrivals[i][0]) if i < len(arrivals) else t + wait
                continue
        elif gathering is not None:
            wait = gathering.wait(t, b)  # type: ignore[arg-type]
            if wait > 0:  # the bridge blocks on its queue: a frame that comes ends the wait
                t = min(t + wait, arrivals[i][0]) if i < len(arrivals) else t + wait
                continue
        slots, _, batch = b.gather(cutoff)
        if not len(slots):
            continue
        steps += 1
        cost = step_s(len(slots))
        if slow_step_at is not None and not slow_done and t >= slow_step_at:
            cost, slow_done = 0.25, True  # one stall of three frames
        if gathering is not None:
            gathering.stepped(t, t + cost)
        t += cost
        for s, frame in zip(slots.tolist(), batch[:, 0].astype(int).tolist(), strict=True):
            assert frame == counter[s]  # every frame, once, in order
            counter[s] += 1
            answered[s].append((frame, t - sent[(s, frame)]))
    return steps * P / t, answered


def test_the_clock_steps_once_a_frame_where_greedy_steps_in_cohorts():
    greedy, _ = simulate(0.0)
    clock, answered = simulate(P)
    assert all(len(a) == 250 for a in answered.values())
    assert clock <= 1.05  # every session in one step a frame
    assert greedy >= 1.8  # stepping at once: cohorts, two steps or more a frame


def bucket_step(step: float):  # a moshi step: its whole bucket, whatever frames it holds
    return lambda n: step


def late_frames(answered: dict[int, list[tuple[int, float]]]) -> int:
    """docs/benchmarks.md's underruns: answers more than a frame behind the session's first
    answer's rhythm (frame ``f`` played at its arrival plus the first answer's latency)."""
    late = 0
    for frames in answered.values():
        first = frames[0][1]
        late += sum(1 for f, lat in frames if lat + (f % 2) * -P > first + P)  # 2nd frame: a frame later
    return late


def test_gathering_steps_the_cohorts_together_under_load():
    """A step costing its bucket (35 ms, moshi's at 512 Hibiki-Zero sessions): at once,
    about 2.3 steps a frame period; gathering, under 1.45, every frame answered within
    two steps and the wait (at once: two steps) and none late."""
    at_once, _ = simulate(0.0, sessions=96, step_s=bucket_step(0.035))
    gathered, answered = simulate(0.0, sessions=96, step_s=bucket_step(0.035), gather=True)
    assert at_once >= 2.0 and gathered <= 1.45
    assert all(len(a) == 250 for a in answered.values())
    assert max(lat for frames in answered.values() for f, lat in frames if f % 2 == 0) <= 3 * 0.035 + 0.01
    assert late_frames(answered) == 0


def test_gathering_holds_a_step_over_half_a_frame_where_at_once_falls_behind():
    """At 44 ms a step (640 sessions) the wait shrinks (a frame's answers may not drift a
    frame), yet the steps a frame period still fall by a quarter."""
    at_once, _ = simulate(0.0, sessions=96, step_s=bucket_step(0.044))
    gathered, answered = simulate(0.0, sessions=96, step_s=bucket_step(0.044), gather=True)
    assert at_once >= 1.6 and gathered <= 1.45
    assert late_frames(answered) == 0


def test_light_load_steps_at_once_as_before():
    """A step under a quarter of a frame: gathering never waits, the steps are at once's."""
    assert simulate(0.0, step_s=bucket_step(0.015), gather=True) == simulate(0.0, step_s=bucket_step(0.015))


def test_no_session_waits_longer_than_for_its_first_frame():
    """Latency may differ between sessions (their phase against the clock), and a session
    may move a tick earlier (its first message came late), but none may wait a tick
    longer than for its first frame: with a one-frame playback buffer, that is a late
    frame. What remains is the step's own growth with the batch as sessions join."""
    _, answered = simulate(P, sessions=64)
    for frames in answered.values():
        first = [lat for f, lat in frames if f % 2 == 0]  # the first frame of each message
        assert max(first) - first[0] < 0.03


def test_after_a_stall_every_session_catches_up():
    _, answered = simulate(P, sessions=32, slow_step_at=8.0)
    for frames in answered.values():
        before = [lat for f, lat in frames if f % 2 == 0 and f < 90]
        after = [lat for f, lat in frames if f % 2 == 0 and f > 120]
        assert max(after) <= max(before) + 0.01  # jitter; a frame behind would be 0.08


def test_a_server_on_the_clock_answers_every_frame_exactly_and_in_order(server_factory):
    """The real server with the clock on (the moshi engine's default), synthetic engine:
    paced sessions of 160 ms messages at different phases and one burst sender all get
    their own bytes back, in order; the steps are counted, not timed."""
    import asyncio

    from tests.native_client import converse, signal

    server = server_factory("--engine-tick-ms", "80", "--step-base-ms", "2", "--text-every", "0")
    frame_bytes = 1920 * 4

    async def session(seed: int, gap: float, delay: float) -> tuple[bytes, bytes, int]:
        await asyncio.sleep(delay)
        audio = signal(20, seed=seed).tobytes()
        chunks = [audio[i : i + 2 * frame_bytes] for i in range(0, len(audio), 2 * frame_bytes)]
        res = await converse(server.ws(), chunks, gap=gap)
        return audio, b"".join(res.frames), res.close_code

    async def main() -> list[tuple[bytes, bytes, int]]:
        paced = [session(k, 2 * P, 0.013 * k) for k in range(6)]
        return await asyncio.gather(*paced, session(99, 0.0, 0.05))

    for sent, received, code in asyncio.run(main()):
        assert received == sent and code == 1000
    metrics = server.metrics()
    steps = metrics["duplexserve_engine_steps_total"]
    assert 20 <= steps < 70  # one a frame (about 30 here), not one a session's frame (140)
    # where a frame's time goes after its step is measured per wake-up of the loop
    wakeups = metrics["duplexserve_loop_pickup_seconds_count"]
    assert 0 < wakeups <= steps and metrics["duplexserve_answer_dispatch_seconds_count"] == wakeups
    # every clock step is a tick (its lag measured) or a catch-up
    ticks = metrics["duplexserve_engine_tick_lag_seconds_count"]
    assert ticks + metrics["duplexserve_engine_catchup_steps_total"] == steps and ticks > 0


def test_a_gathering_server_answers_every_frame_exactly_and_in_order(server_factory):
    """The real server gathering (``--engine-gather on``), synthetic engine stepping 30 ms
    (over the floor): paced sessions at different phases and a burst sender get their own
    bytes back, in order, and steps did wait."""
    import asyncio

    from tests.native_client import converse, signal

    server = server_factory("--engine-gather", "on", "--step-base-ms", "30", "--text-every", "0")
    frame_bytes = 1920 * 4

    async def session(seed: int, gap: float, delay: float) -> tuple[bytes, bytes, int]:
        await asyncio.sleep(delay)
        audio = signal(20, seed=seed).tobytes()
        chunks = [audio[i : i + 2 * frame_bytes] for i in range(0, len(audio), 2 * frame_bytes)]
        res = await converse(server.ws(), chunks, gap=gap)
        return audio, b"".join(res.frames), res.close_code

    async def main() -> list[tuple[bytes, bytes, int]]:
        paced = [session(k, 2 * P, 0.013 * k) for k in range(6)]
        return await asyncio.gather(*paced, session(99, 0.0, 0.05))

    for sent, received, code in asyncio.run(main()):
        assert received == sent and code == 1000
    metrics = server.metrics()
    assert metrics["duplexserve_engine_gather_waits_total"] > 0
    assert metrics["duplexserve_engine_gather_wait_seconds_total"] > 0


def test_stepping_at_once_is_the_default_and_the_clock_is_chosen():
    from duplexserve.config import ServerConfig

    assert ServerConfig(engine="moshi", device="cuda").engine_tick_ms == 0.0
    assert ServerConfig(engine="moshi").engine_gather == "off"
    assert ServerConfig(engine="synthetic", engine_tick_ms=80.0).engine_tick_ms == 80.0
    with pytest.raises(ValueError):
        ServerConfig(engine="synthetic", engine_tick_ms=-1.0).validate()
