"""The moshi engine behind the real server: 8 concurrent sessions over real sockets.

Greedy decoding with the tiny preset: a session's answer is a function of its own
input alone, so sessions sent the same audio must hear the same answer, whatever else
the batch held, and a session taking the slot of one that just left must too. In
float64: a step runs only the rows its live sessions need (row_buckets.py), and batches
of different sizes round differently in float32 (about 1e-7), enough to flip an argmax.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import websockets.asyncio.client

FLAGS = (
    "--engine", "moshi", "--moshi-preset", "tiny", "--moshi-greedy", "--moshi-threads", "1",
    "--moshi-dtype", "float64",
)  # fmt: skip
FRAMES = 24
DELAY = 1  # the tiny preset's LM delay, in frames


def audio(seed: int, frames: int = FRAMES) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((frames, 1920)) * 0.1).astype(np.float32)


async def session(url: str, x: np.ndarray, close_early: bool = False) -> np.ndarray:
    """Send ``x`` in 160 ms messages; return the output frames received."""
    out: list[np.ndarray] = []
    async with websockets.asyncio.client.connect(url, max_size=None) as ws:
        created = json.loads(await ws.recv())
        assert created["type"] == "session.created" and created["engine"] == "moshi"

        async def send() -> None:
            for i in range(0, len(x), 2):
                await ws.send(x[i : i + 2].tobytes())
                await asyncio.sleep(0.02)
            await ws.send(json.dumps({"type": "session.close" if close_early else "input.end"}))

        sender = asyncio.create_task(send())
        closed = None
        async for message in ws:
            if isinstance(message, bytes):
                out.append(np.frombuffer(message, np.float32))
            else:
                event = json.loads(message)
                assert event["type"] != "error", event
                if event["type"] == "session.closed":
                    closed = event
        await sender
    assert closed is not None
    if not close_early:
        assert closed["reason"] == "completed"
        assert closed["frames_in"] == len(x) and closed["frames_dropped"] == 0
        assert closed["frames_out"] == len(x) + DELAY and closed["frames_tail"] == DELAY  # input.end's tail
    return np.stack(out) if out else np.zeros((0, 1920), np.float32)


async def eight_sessions(url: str) -> tuple[list[np.ndarray], np.ndarray]:
    x, y = audio(1), audio(2)

    async def replaced_slot() -> np.ndarray:
        await session(url, audio(3, 8), close_early=True)  # leaves mid-stream
        return await session(url, x)  # its slot's next occupant

    results = await asyncio.gather(*[session(url, x if i < 4 else y) for i in range(7)], replaced_slot())
    return list(results), x


@pytest.mark.parametrize("mode", [(), ("--engine-process",)], ids=["engine-thread", "engine-process"])
def test_eight_concurrent_sessions(server_factory, mode):
    server = server_factory(*FLAGS, *mode, "--max-sessions", "8")
    outputs, _ = asyncio.run(eight_sessions(server.ws()))
    for out in outputs:
        assert out.shape == (FRAMES + DELAY, 1920)  # one per input frame, then the delay's tail
        level = np.abs(out).max(axis=1)
        assert (level[:DELAY] == 0).all() and (level[DELAY:] > 0).all()
    same_as_x = [0, 1, 2, 3, 7]
    for i in same_as_x[1:]:
        np.testing.assert_allclose(outputs[i], outputs[0], rtol=0, atol=1e-7)  # float32 on the wire
    for i in (5, 6):
        np.testing.assert_allclose(outputs[i], outputs[4], rtol=0, atol=1e-7)
    assert np.abs(outputs[4] - outputs[0]).max() > 1e-6  # another input, another answer
