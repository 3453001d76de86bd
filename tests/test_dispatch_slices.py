"""A step's answers go out in slices of loop time, the loop polling its sockets between.

The server runs in this process (tests.test_opus_fastpath's harness) so that the test can
shrink the slice and count the slices; real WebSocket clients on loopback check every
session's answers byte for byte and in order, with the results of several steps queued
behind each other (burst senders) and errors of a closed session in between.
"""

from __future__ import annotations

import asyncio

import pytest

from duplexserve.server.core import orchestrator as orchestrator_module
from tests.native_client import converse, signal
from tests.test_opus_fastpath import InProcessServer

FRAME_BYTES = 1920 * 4


async def session(url: str, seed: int, frames: int, gap: float) -> tuple[bytes, bytes, int | None]:
    audio = signal(frames, seed=seed).tobytes()
    chunks = [audio[i : i + 2 * FRAME_BYTES] for i in range(0, len(audio), 2 * FRAME_BYTES)]
    res = await converse(url, chunks, gap=gap)
    return audio, b"".join(res.frames), res.close_code


@pytest.mark.parametrize("slice_s", [0.0, 10.0])
def test_answers_go_out_in_slices_and_stay_exact_and_in_order(monkeypatch, slice_s):
    """Slice 0: DISPATCH_CHECK_ROWS sessions send per turn of the loop, so a step of 40
    sessions takes three turns; a long slice lets all of them send at once. Either way
    every session gets its own bytes back, in order."""
    monkeypatch.setattr(orchestrator_module, "DISPATCH_SLICE_S", slice_s)
    notified = [0]  # sessions let send: each takes its next frames (pump), then sends
    per_slice: list[int] = []
    touched: list[int] = []  # sessions with answers waiting when each slice began
    with InProcessServer(engine_tick_ms=40.0, text_every=0, max_sessions=64) as server:
        orch = server.app.orchestrator
        pump = orch.pump

        def counted_pump(session) -> None:
            notified[0] += 1
            pump(session)

        orch.pump = counted_pump
        slice_ = orch._notify

        def counted_slice() -> None:
            before = notified[0]
            touched.append(len(orch._touched))
            slice_()
            per_slice.append(notified[0] - before)

        orch._notify = counted_slice

        async def main() -> list[tuple[bytes, bytes, int | None]]:
            paced = [session(server.ws(), k, 12, 0.08) for k in range(36)]
            bursts = [session(server.ws(), 100 + k, 24, 0.0) for k in range(4)]
            return await asyncio.gather(*paced, *bursts)

        for sent, received, code in asyncio.run(main()):
            assert received == sent and code == 1000
    check = orchestrator_module.DISPATCH_CHECK_ROWS
    if slice_s:  # every slice lets all the sessions waiting send, more than one turn's worth
        drained = [sent >= waiting for sent, waiting in zip(per_slice, touched, strict=True)]
        assert all(drained), (per_slice, touched)
        assert max(touched) > check, touched
    else:
        assert max(per_slice) == check and len(per_slice) >= 2 * 12  # 3 turns a step of 40
