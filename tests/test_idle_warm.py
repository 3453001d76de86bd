"""Start-up work an engine leaves for later (``Engine.warm``: the moshi engine's buckets
above ``--moshi-warm-rows``) runs on the engine thread only while no session is open, a
piece at a time, so that it never delays a live session's frame."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from duplexserve.engine_bridge.bridge import EngineBridge
from duplexserve.engine_bridge.synthetic import SyntheticEngine


class DeferringEngine(SyntheticEngine):
    """The synthetic engine with ``pieces`` pieces of start-up work of 20 ms each left."""

    def __init__(self, pieces: int) -> None:
        super().__init__(4)
        self.pieces = pieces
        self.calls: list[str] = []

    def warm(self) -> bool:
        time.sleep(0.02)
        self.pieces -= 1
        self.calls.append("warm")
        return self.pieces > 0

    def open(self, slot: int, params: dict[str, Any]) -> None:
        self.calls.append("open")
        super().open(slot, params)

    def close(self, slot: int) -> None:
        self.calls.append("close")
        super().close(slot)

    def step(self, slots: np.ndarray, frames: np.ndarray):
        self.calls.append("step")
        return super().step(slots, frames)


def test_start_up_work_runs_while_no_session_is_open_and_every_piece_of_it_runs():
    async def main() -> list[str]:
        engine = DeferringEngine(pieces=8)
        bridge = EngineBridge(engine, lambda outputs: None)
        await bridge.start()
        try:
            bridge.open(0, 1, {})
            frame = np.zeros(1920, np.float32)
            for _ in range(10):
                bridge.try_submit((0, 1, frame))
                await asyncio.sleep(0.02)
            bridge.close(0, 1)
            for _ in range(200):
                if engine.pieces == 0:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.6)  # then nothing more is asked of it
        finally:
            await bridge.stop()
        return engine.calls

    calls = asyncio.run(main())
    assert calls.count("warm") == 8, calls
    opened = calls.index("open")
    closed = calls.index("close")
    assert "warm" not in calls[opened:closed], calls  # not while the session was open
    assert calls.count("step") == 10 and "warm" in calls[closed:], calls
