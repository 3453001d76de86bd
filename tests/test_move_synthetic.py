"""Live migration's engine seam on the synthetic engine (issue 76): a slot exported from one
bridge and imported into another goes on exactly, and a state that does not fit is refused.

Two real bridges, each with its engine thread: the export is ordered after the frames submitted
before it, and their answers reach the session before it resolves.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from duplexserve.engine_bridge.bridge import EngineBridge, StepOutput
from duplexserve.engine_bridge.engine import MoveRefused
from duplexserve.engine_bridge.synthetic import SyntheticEngine

FRAMES = 20
CUT = 9


def frame(i: int) -> np.ndarray:
    return np.full(1920, i + 1, np.float32)


class Collected:
    """The answers one slot got: (first sample, text) per frame, in order."""

    def __init__(self) -> None:
        self.out: list[tuple[float, str | None]] = []

    def __call__(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            assert out.error is None and out.audio is not None
            for row in range(len(out.slots)):
                self.out.append((float(out.audio[row][0]), out.text.get(row)))


async def wait_for(collected: Collected, count: int) -> None:
    while len(collected.out) < count:
        await asyncio.sleep(0.005)


async def stream(bridge: EngineBridge, slot: int, generation: int, first: int, last: int,
                 answered: Collected, base: int = 0) -> None:
    """Frames ``first`` to ``last - 1``, at most 4 in flight (the bridge's window is 8)."""
    for i in range(first, last):
        while i - base - len(answered.out) >= 4 or not bridge.try_submit((slot, generation, frame(i))):
            await asyncio.sleep(0.002)


def engine(delay: int = 2) -> SyntheticEngine:
    return SyntheticEngine(4, delay_frames=delay, text_every=3)


@pytest.mark.parametrize("delay", [0, 2])
def test_a_moved_slot_goes_on_exactly(delay: int) -> None:
    async def main() -> tuple[list, list, list]:
        ref, a_out, b_out = Collected(), Collected(), Collected()
        ref_bridge = EngineBridge(engine(delay), ref)
        a, b = EngineBridge(engine(delay), a_out), EngineBridge(engine(delay), b_out)
        for bridge in (ref_bridge, a, b):
            await bridge.start()
        ref_bridge.open(1, 1, {})
        await stream(ref_bridge, 1, 1, 0, FRAMES, ref)
        await wait_for(ref, FRAMES)
        a.open(0, 7, {})
        await stream(a, 0, 7, 0, CUT, a_out)
        state = await a.export(0, 7)  # no wait for the answers: the export is ordered after them
        assert len(a_out.out) == CUT
        await b.import_(3, 11, state)  # another slot, another generation
        await stream(b, 3, 11, CUT, FRAMES, b_out, CUT)
        await wait_for(b_out, FRAMES - CUT)
        for bridge in (ref_bridge, a, b):
            await bridge.stop()
        return ref.out, a_out.out, b_out.out

    ref, before, after = asyncio.run(asyncio.wait_for(main(), 30))
    assert before + after == ref
    assert ref[0][0] == (0.0 if delay else 1.0)


def test_a_state_that_does_not_fit_is_refused() -> None:
    source = engine(2)
    source.open(0, {})
    state = source.export_slot(0)
    with pytest.raises(MoveRefused) as exc:
        engine(3).import_slot(0, state)
    assert exc.value.code == "move_mismatch"
    for bad in (b"", b"\x05\x00\x00\x00{nope", state[:-4]):
        with pytest.raises(MoveRefused) as exc:
            engine(2).import_slot(0, bad)
        assert exc.value.code == "move_corrupt"


def test_the_bridge_says_why_a_move_was_refused() -> None:
    async def main() -> tuple[str, str]:
        bridge = EngineBridge(engine(2), lambda outputs: None)
        await bridge.start()
        try:
            with pytest.raises(MoveRefused) as gone:
                await bridge.export(2, 5)  # never opened
            with pytest.raises(MoveRefused) as corrupt:
                await bridge.import_(2, 5, b"junk")
            bridge.open(2, 6, {})
            assert await bridge.export(2, 6)  # the slot stays open after a refused import
            return gone.value.code, corrupt.value.code
        finally:
            await bridge.stop()

    assert asyncio.run(asyncio.wait_for(main(), 30)) == ("move_gone", "move_corrupt")
