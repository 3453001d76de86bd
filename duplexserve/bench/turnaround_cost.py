"""CPU per frame of the turnaround bookkeeping alone (server/core/turnaround.py), flushes included.

The burst A/B (``duplexserve bench ab-burst``) prices the whole change but on a busy machine its
repetitions scatter by +-15%; this counts the added work itself, in process CPU time,
for one 80 ms message per frame as the burst sends: the session's arrival append, the
writer's clock read and ``sent``, and the numpy flush every 512 frames.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import uvloop

from duplexserve.server.core.replay import ReplayRing
from duplexserve.server.core.turnaround import FLUSH_FRAMES, FrameTimer, TurnaroundTotals

FRAMES = 256 * 400


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No options: a fixed count of frames, best of seven."""


def run(args: argparse.Namespace) -> None:
    uvloop.run(measure())


async def measure() -> None:
    clock = asyncio.get_running_loop().time
    best: dict[str, float] = {}
    for _ in range(7):
        timer = FrameTimer(TurnaroundTotals())
        arrived, sent_times, flush = timer.arrivals.extend, timer.sent_times, timer.flush
        t0 = time.process_time()
        for i in range(FRAMES):  # what the session core and the writer do per frame
            arrived((i + 1, clock()))
            sent_times.append(clock())
            if len(sent_times) >= FLUSH_FRAMES:
                flush()
        flush()
        best["turnaround"] = min(best.get("turnaround", 1e9), (time.process_time() - t0) / FRAMES)
        ring, data = ReplayRing(256, 7680), bytes(7680)
        t0 = time.process_time()
        for i in range(FRAMES):
            ring.add(i, data)
        best["replay ring"] = min(best.get("replay ring", 1e9), (time.process_time() - t0) / FRAMES)
        t0 = time.process_time()
        for _ in range(FRAMES):
            pass
        best["empty loop"] = min(best.get("empty loop", 1e9), (time.process_time() - t0) / FRAMES)
    for name, seconds in best.items():
        print(f"{name}: {seconds * 1e9:.0f} ns CPU per frame")
