"""How late the server answers: per-frame turnaround, in bulk, in session.closed and /metrics."""

from __future__ import annotations

import asyncio

import numpy as np

from duplexserve.server.core.turnaround import FLUSH_FRAMES, FrameTimer, TurnaroundTotals, percentiles
from tests.native_client import converse
from tests.native_client import signal as noise

FRAME_BYTES = 1920 * 4


def test_timer_pairs_each_output_frame_with_the_message_that_carried_its_input():
    totals = TurnaroundTotals(late_s=0.2)
    timer = FrameTimer(totals)
    timer.arrived(2, 10.0)  # one message completing frames 0 and 1
    timer.arrived(3, 10.5)  # frame 2
    timer.arrived(6, 11.0)  # frames 3, 4, 5
    sends = [10.01, 10.02, 10.9, 11.1, 11.3, 11.05]
    for i, t in enumerate(sends):
        timer.sent(i, t)
    timer.sent(2, 99.0)  # sent again after a resume: timed once only
    summary = timer.summary()
    expected = np.array([0.01, 0.02, 0.4, 0.1, 0.3, 0.05])
    assert timer.count == 6 and totals.count == 6
    assert timer.late == totals.late == 2  # 0.4 and 0.3 are over 0.2
    assert np.isclose(totals.sum_s, expected.sum())
    assert summary["max"] == 400.0
    assert summary["p50"] == 75.0  # the median of 10, 20, 50, 100, 300, 400 ms
    assert totals.buckets.sum() == 6


def test_tail_frames_after_input_end_are_not_timed():
    """Output frames past the last input frame (input.end's tail) answer no message: a
    translation model's tail can run for seconds, which is no turnaround of the server."""
    totals = TurnaroundTotals(late_s=0.2)
    timer = FrameTimer(totals)
    timer.arrived(3, 10.0)
    for i, t in enumerate([10.05, 10.06, 10.07, 12.0, 14.0]):  # frames 3 and 4: the tail
        timer.sent(i, t)
    timer.flush()
    assert timer.count == totals.count == 3 and timer.late == 0
    assert abs(timer.summary()["max"] - 70.0) < 1e-6
    for i, t in enumerate([16.0, 18.0], start=5):  # more of the tail, flushed alone
        timer.sent(i, t)
    timer.flush()
    assert timer.count == 3


def test_timer_flushes_in_bulk_and_forgets_what_it_timed():
    totals = TurnaroundTotals()
    timer = FrameTimer(totals)
    n = FLUSH_FRAMES * 3 + 5
    for i in range(n):
        timer.arrived(i + 1, float(i))
        timer.sent(i, i + 0.05)
    assert totals.count == FLUSH_FRAMES * 3  # three bulk flushes, nothing per frame
    assert len(timer.arrivals) == 2 * 5  # only the messages of the 5 frames not yet flushed
    timer.flush()
    assert totals.count == n and totals.late == 0


def test_percentiles_are_numpys_linear_estimate():
    rng = np.random.default_rng(5)
    for n in (1, 2, 3, 10, 750, 16384):
        values = rng.random(n).astype(np.float32)
        np.testing.assert_allclose(percentiles(values, (0.0, 50.0, 99.0, 100.0)),
                                   np.percentile(values, (0, 50, 99, 100)), rtol=1e-6)  # fmt: skip


def test_session_closed_reports_turnaround_and_late_frames(server_factory):
    # Each engine step waits 30 ms: every frame is later than a 5 ms deadline.
    server = server_factory("--step-base-ms", "30", "--late-frame-ms", "5")
    audio = noise(20, seed=31).tobytes()
    chunks = [audio[i : i + FRAME_BYTES] for i in range(0, len(audio), FRAME_BYTES)]
    res = asyncio.run(converse(server.ws(), chunks))
    closed = res.closed
    assert closed["late_frames"] == 20
    turn = closed["turnaround_ms"]
    assert set(turn) == {"p50", "p99", "max"}
    assert 5.0 < turn["p50"] <= turn["p99"] <= turn["max"]
    metrics = server.metrics()
    assert metrics["duplexserve_frame_turnaround_seconds_count"] == 20
    assert metrics["duplexserve_frames_late_total"] == 20
    assert metrics['duplexserve_frame_turnaround_seconds_bucket{le="+Inf"}'] == 20
    assert metrics['duplexserve_frame_turnaround_seconds_bucket{le="0.001"}'] == 0


def test_every_frame_is_timed_also_when_messages_carry_several(echo_server):
    res = asyncio.run(converse(echo_server.ws(), [noise(10, seed=32).tobytes()]))
    turn = res.closed["turnaround_ms"]
    assert 0 < turn["p50"] <= turn["p99"] <= turn["max"]
    assert 0 <= res.closed["late_frames"] <= 10


def test_turnaround_starts_at_the_message_that_carried_the_frame(echo_server):
    """A frame's turnaround lies inside the client's own round trip for it: paced messages
    far apart must not be timed from the message before (the fast path once read the
    receive time before it set it, and every frame came out one message gap late)."""
    import json

    import websockets.asyncio.client

    async def paced() -> tuple[float, dict]:
        frames = noise(6, seed=33).reshape(6, 1920)
        worst = 0.0
        async with websockets.asyncio.client.connect(echo_server.ws(), compression=None, max_size=None) as ws:
            await ws.recv()  # session.created
            for frame in frames:
                sent = asyncio.get_running_loop().time()
                await ws.send(frame.tobytes())
                while isinstance(await ws.recv(), str):  # the frame's answer, past any event
                    pass
                worst = max(worst, asyncio.get_running_loop().time() - sent)
                await asyncio.sleep(0.15)
            await ws.send(json.dumps({"type": "input.end"}))
            async for message in ws:
                if isinstance(message, str) and json.loads(message)["type"] == "session.closed":
                    return worst, json.loads(message)
        raise AssertionError("no session.closed")

    worst, closed = asyncio.run(paced())
    assert closed["turnaround_ms"]["max"] <= 1000 * worst + 1.0, (closed["turnaround_ms"], worst)
