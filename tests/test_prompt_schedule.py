"""The engine thread runs prompts between steps, at most one prefill between two steps.

A real ``EngineBridge`` and its engine thread, in front of an engine that records what it
is asked in which order: one session streams while five prompts arrive at once (three
never run before, two repeats). The live session is stepped between every two prefills,
the repeats (a copy of cached keys and values) add no wait, every prompt is answered
on the loop, and a prompt for a session that ended meanwhile is answered too.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from duplexserve.engine_bridge.bridge import EngineBridge
from duplexserve.engine_bridge.engine import PromptError
from duplexserve.engine_bridge.synthetic import SyntheticEngine


class RecordingEngine(SyntheticEngine):
    takes_prompts = True
    voices = ("voice.pt",)

    def __init__(self) -> None:
        super().__init__(8)
        self.calls: list[tuple[str, Any]] = []
        self.seen: set[str] = set()

    def prompt_cached(self, params: dict[str, Any]) -> bool:
        return params["text_prompt"] in self.seen

    def prompt(self, slot: int, params: dict[str, Any]) -> None:
        if params["text_prompt"] == "refused":
            raise PromptError("invalid_prompt", "too long")
        self.calls.append(("cached" if self.prompt_cached(params) else "prefill", slot))
        self.seen.add(params["text_prompt"])

    def step(self, slots: np.ndarray, frames: np.ndarray):
        self.calls.append(("step", tuple(slots.tolist())))
        return super().step(slots, frames)


def test_at_most_one_prefill_runs_between_two_steps():
    async def main() -> tuple[list, dict]:
        engine = RecordingEngine()
        bridge = EngineBridge(engine, lambda outputs: None)
        await bridge.start()
        outcomes: dict[int, Any] = {}
        try:
            bridge.open(0, 1, {})
            frame = np.zeros(1920, np.float32)
            for _ in range(4):  # the live session's first frames
                bridge.try_submit((0, 1, frame))
            await asyncio.sleep(0.05)
            texts = {1: "support agent", 2: "tutor", 3: "support agent", 4: "guide", 5: "tutor", 6: "refused"}
            for slot, text in texts.items():
                bridge.open(slot, 1, {})
                bridge.prompt(slot, 1, {"text_prompt": text}, lambda o, s=slot: outcomes.__setitem__(s, o))
            bridge.close(4, 1)  # ends before its prompt could run
            for _ in range(12):  # the live session keeps streaming
                bridge.try_submit((0, 1, frame))
                await asyncio.sleep(0.01)
            for _ in range(100):
                if len(outcomes) == len(texts):
                    break
                await asyncio.sleep(0.01)
        finally:
            await bridge.stop()
        return engine.calls, outcomes

    calls, outcomes = asyncio.run(main())
    assert outcomes == {
        1: None, 2: None, 3: None, 5: None,
        4: ("engine_error", "the session ended before its prompt ran"),
        6: ("invalid_prompt", "too long"),
    }  # fmt: skip
    prompts = [(kind, slot) for kind, slot in calls if kind != "step"]
    assert prompts == [("prefill", 1), ("prefill", 2), ("cached", 3), ("cached", 5)]  # in order
    since_step = 0
    for kind, _ in calls:
        since_step = 0 if kind == "step" else since_step + (kind == "prefill")
        assert since_step <= 1, calls
    first, second = (i for i, call in enumerate(calls) if call[0] == "prefill")
    assert any(kind == "step" for kind, _ in calls[first:second])


def test_prompts_seen_before_run_between_steps_for_a_bounded_time():
    """A burst of sessions with a prompt the engine has seen (each a copy, here 15 ms) is
    spread over the live session's steps: at most two copies between two steps (the
    budget is 20 ms; a copy that overruns it alone makes one)."""

    class SlowCopies(RecordingEngine):
        def prompt(self, slot: int, params: dict[str, Any]) -> None:
            time.sleep(0.015)
            super().prompt(slot, params)

    async def main() -> list:
        engine = SlowCopies()
        engine.seen.add("persona")
        bridge = EngineBridge(engine, lambda outputs: None)
        await bridge.start()
        done: list[int] = []
        try:
            bridge.open(0, 1, {})
            frame = np.zeros(1920, np.float32)
            for slot in range(1, 7):
                bridge.open(slot, 1, {})
                bridge.prompt(slot, 1, {"text_prompt": "persona"}, lambda o, s=slot: done.append(s))
            for _ in range(8):  # frames due all along: a step between every two rounds of prompts
                bridge.try_submit((0, 1, frame))
            for _ in range(100):
                if len(done) == 6:
                    break
                await asyncio.sleep(0.01)
        finally:
            await bridge.stop()
        return engine.calls

    calls = asyncio.run(main())
    assert [slot for kind, slot in calls if kind == "cached"] == [1, 2, 3, 4, 5, 6]
    run = 0
    for kind, _ in calls:
        run = 0 if kind == "step" else run + 1
        assert run <= 2, calls
