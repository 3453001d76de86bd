"""The engine thread's own CPU: the bridge and a zero-cost echo, no sockets.

``duplexserve bench bridge-cost --sessions 4,16,64``

Each session keeps ``--window`` frames in flight: the loop hands frames over with
``try_submit`` (views of bytes, as received), and every answer puts that session's next
frame in, so each step carries about as many frames as there are sessions. The engine
thread's CPU time (from /proc, by its native id) over the run, per step and per frame,
is what the hand-off, the batcher and the echo cost it; the line fitted through the
levels splits it into a cost per step and a cost per frame. The loop's side is printed
beside it. With the server's burst the engine thread costs more per frame than here:
there it shares its core with a busy loop thread (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import numpy as np

from duplexserve.codecs.procpool import stat_cpu_seconds
from duplexserve.engine_bridge.bridge import EngineBridge
from duplexserve.engine_bridge.synthetic import SyntheticEngine

FRAME_SAMPLES = 1920


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", default="4,16,64", help="levels: sessions (so frames a step) each")
    p.add_argument("--frames", type=int, default=128_000, help="frames at each level, over all sessions")
    p.add_argument("--window", type=int, default=4, help="frames in flight a session")
    p.add_argument("--coalesce-ms", type=float, default=1.0, help="the server's --engine-coalesce-ms")
    p.add_argument("--out", default="", help="write the rows as JSON here")


async def _level(sessions: int, frames: int, window: int, coalesce_s: float) -> dict[str, Any]:
    per_session = frames // sessions
    got, sent = [0] * sessions, [0] * sessions
    payload = [np.random.default_rng(i).standard_normal(FRAME_SAMPLES).astype(np.float32).tobytes()
               for i in range(sessions)]  # fmt: skip
    done = asyncio.Event()

    def submit(slot: int) -> None:
        sent[slot] += 1
        bridge.try_submit((slot, 1, np.frombuffer(bytes(payload[slot]), np.float32)))  # a fresh message

    def on_outputs(outputs: list[Any]) -> None:
        for out in outputs:
            for slot in out.slots.tolist():
                got[slot] += 1
                if sent[slot] < per_session:
                    submit(slot)
        if all(g >= per_session for g in got):
            done.set()

    bridge = EngineBridge(SyntheticEngine(sessions), on_outputs, coalesce_s=coalesce_s)
    await bridge.start()
    try:
        for slot in range(sessions):
            bridge.open(slot, 1, {})
        await asyncio.sleep(0.05)
        assert bridge._thread is not None and bridge._thread.native_id is not None
        stat = f"/proc/self/task/{bridge._thread.native_id}/stat"
        engine0, process0, wall0 = stat_cpu_seconds(stat), time.process_time(), time.perf_counter()
        steps0 = bridge.counts.steps
        for slot in range(sessions):
            for _ in range(min(window, per_session)):
                submit(slot)
        await done.wait()
        engine = stat_cpu_seconds(stat) - engine0
        process, wall = time.process_time() - process0, time.perf_counter() - wall0
        steps = bridge.counts.steps - steps0
    finally:
        await bridge.stop()
    n = per_session * sessions
    return {
        "sessions": sessions, "frames": n, "steps": steps, "frames_per_step": n / steps,
        "engine_us_per_step": 1e6 * engine / steps, "engine_us_per_frame": 1e6 * engine / n,
        "loop_us_per_frame": 1e6 * (process - engine) / n, "wall_s": wall,
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import uvloop

    rows = [
        uvloop.run(_level(int(s), args.frames, args.window, args.coalesce_ms / 1000))
        for s in args.sessions.split(",")
    ]
    print(f"{'sessions':>8} {'frames/step':>11} {'engine us/step':>14} {'engine us/frame':>15} "
          f"{'loop us/frame':>13}")  # fmt: skip
    for r in rows:
        print(f"{r['sessions']:>8} {r['frames_per_step']:>11.1f} {r['engine_us_per_step']:>14.1f} "
              f"{r['engine_us_per_frame']:>15.2f} {r['loop_us_per_frame']:>13.2f}")  # fmt: skip
    fit: dict[str, float] = {}
    if len(rows) > 1:  # engine CPU a step = per_step + per_frame x frames a step
        per_frame, per_step = np.polyfit(
            [r["frames_per_step"] for r in rows], [r["engine_us_per_step"] for r in rows], 1
        )
        fit = {"per_step_us": float(per_step), "per_frame_us": float(per_frame)}
        print(f"engine thread: {per_step:.1f} us a step + {per_frame:.2f} us a frame")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "bridge-cost", "args": vars(args), "rows": rows, "fit": fit}, f, indent=1)
    return 0
