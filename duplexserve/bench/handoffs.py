"""An engine step's wall time with the event loop idle and saturated, the engine in its own process.

``duplexserve bench handoffs --sessions 64 [serve's engine options]``

Why: while the engine process steps, the engine thread waits on its pipe with the GIL let
go, and every such wait ends with taking the GIL back from the event loop. A loop that never
blocks (a flood of HTTP requests: issue 67) hands it over only when the interpreter's switch
interval (5 ms) forces it to, so each hand-off of a step costs up to that much. This bench
runs the real bridge and engine process with ``--sessions`` sessions paced at 12.5 frames a
second (each at most ``--inflight`` frames ahead of its answers), in phases of ``--seconds``:
the loop idle, then saturated by a callback chain of pure Python work that never lets the
loop block (as the flood kept it), for each switch interval of ``--switch-intervals-ms``.
Per phase: the step's wall time on the engine thread, the child's own time for it, the
answer's wait for the GIL (``ProcessEngine.gil_wait_s``) and the hand-offs a step
(``ProcessEngine.handoffs``). Printed as a table and written as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from typing import Any

import numpy as np

from duplexserve.config import ServerConfig
from duplexserve.engine_bridge.bridge import EngineBridge, StepOutput
from duplexserve.engine_bridge.process_engine import ProcessEngine

FRAME_S = 0.08


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=64, help="live sessions, paced at real time")
    p.add_argument("--seconds", type=float, default=4.0, help="each phase's length")
    p.add_argument("--inflight", type=int, default=4, help="frames a session may be ahead of its answers")
    p.add_argument(
        "--switch-intervals-ms", default="5,0.5",
        help="sys.setswitchinterval of each pair of phases (idle, saturated); 5: Python's",
    )  # fmt: skip
    p.add_argument("--busy-us", type=float, default=200.0, help="one saturating callback's work")
    p.add_argument("--bench-out", default="handoffs.json", help="write the phases as JSON here")
    ServerConfig.add_arguments(p)


class Phases:
    """The steps of each phase, as the engine thread reports them."""

    def __init__(self, engine: ProcessEngine) -> None:
        self.engine = engine
        self.name = "warm-up"
        self.rows: dict[str, list[tuple[float, float, float, int]]] = {}

    def on_step(self, out: StepOutput) -> None:  # the engine thread's
        engine = self.engine
        row = (out.duration_s, engine.child_step_s, out.gil_wait_s, len(out.slots))
        self.rows.setdefault(self.name, []).append(row)


async def _measure(config: ServerConfig, args: argparse.Namespace) -> list[dict[str, Any]]:
    loop = asyncio.get_running_loop()
    engine = ProcessEngine(config)
    phases = Phases(engine)
    n, inflight = args.sessions, np.zeros(args.sessions, np.int64)

    def on_outputs(outs: list[StepOutput]) -> None:
        for out in outs:
            if out.audio is not None:
                np.subtract.at(inflight, out.slots, 1)

    bridge = EngineBridge(
        engine, on_outputs, queue_size=config.queue_size, window=config.inflight_frames,
        on_step=phases.on_step, tick_s=config.engine_tick_ms / 1000, gather=config.engine_gather == "on",
    )  # fmt: skip
    await bridge.start()
    frames = [np.random.default_rng(i).standard_normal(1920).astype(np.float32) for i in range(n)]
    for slot in range(n):
        bridge.open(slot, 1, {})
    due = loop.time()
    saturating = False
    busy_s = args.busy_us / 1e6

    def feed() -> None:
        nonlocal due
        for slot in np.flatnonzero(inflight < args.inflight).tolist():
            if bridge.try_submit((slot, 1, frames[slot])):
                inflight[slot] += 1
        due += FRAME_S
        loop.call_at(due, feed)

    def busy() -> None:  # pure Python, never blocking: the loop as an HTTP flood keeps it
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:
            pass
        if saturating:
            loop.call_soon(busy)

    feed()
    await asyncio.sleep(2.0)  # warm-up
    results = []
    try:
        for ms in (float(x) for x in args.switch_intervals_ms.split(",")):
            sys.setswitchinterval(ms / 1000)
            for saturated in (False, True):
                phases.name = f"{'saturated' if saturated else 'idle'} loop, switch interval {ms:g} ms"
                handoffs = engine.handoffs
                saturating = saturated
                if saturated:
                    loop.call_soon(busy)
                await asyncio.sleep(args.seconds)
                saturating = False
                results.append(_summary(phases.name, phases.rows.get(phases.name, []),
                                        engine.handoffs - handoffs, saturated, ms))  # fmt: skip
                await asyncio.sleep(0.5)
    finally:
        sys.setswitchinterval(0.005)
        await bridge.stop()
    return results


def _summary(name: str, rows: list[tuple[float, float, float, int]], handoffs: int, saturated: bool,
             switch_ms: float) -> dict[str, Any]:  # fmt: skip
    if not rows:
        return {"phase": name, "steps": 0}
    wall, child, gil, batch = (np.array(c, np.float64) for c in zip(*rows, strict=True))
    wall_50, wall_99, gil_50, gil_99 = (1000 * float(np.percentile(a, q)) for a in (wall, gil)
                                        for q in (50, 99))
    return {
        "phase": name, "saturated": saturated, "switch_interval_ms": switch_ms, "steps": len(rows),
        "frames_per_step": float(batch.mean()), "handoffs_per_step": handoffs / len(rows),
        "wall_ms_p50": wall_50, "wall_ms_p99": wall_99, "wall_ms_mean": 1000 * float(wall.mean()),
        "child_ms_mean": 1000 * float(child.mean()), "gil_wait_ms_p50": gil_50, "gil_wait_ms_p99": gil_99,
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import uvloop

    config = dataclasses.replace(ServerConfig.from_namespace(args), engine_process=True)
    if config.max_sessions < args.sessions:
        config = dataclasses.replace(config, max_sessions=args.sessions)
    config.validate()
    rows = uvloop.run(_measure(config, args))
    print(f"{'phase':<42} {'steps':>6} {'frames':>6} {'hand-offs':>9} {'wall p50':>8} {'p99':>7} "
          f"{'child':>6} {'GIL wait p50':>12} {'p99':>7}  (ms a step)")  # fmt: skip
    for r in rows:
        if not r["steps"]:
            print(f"{r['phase']:<42} no step")
            continue
        print(f"{r['phase']:<42} {r['steps']:>6} {r['frames_per_step']:>6.1f} {r['handoffs_per_step']:>9.1f} "
              f"{r['wall_ms_p50']:>8.2f} {r['wall_ms_p99']:>7.2f} {r['child_ms_mean']:>6.2f} "
              f"{r['gil_wait_ms_p50']:>12.2f} {r['gil_wait_ms_p99']:>7.2f}")  # fmt: skip
    with open(args.bench_out, "w") as f:
        json.dump({"benchmark": "handoffs", "sessions": args.sessions, "engine": config.engine,
                   "rows": rows}, f, indent=1)  # fmt: skip
    return 0
