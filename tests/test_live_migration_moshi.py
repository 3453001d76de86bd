"""Live migration of moshi sessions (issue 76): the engine's state moves with the call.

Two replicas of the tiny moshi preset (float64, greedy), 64 live calls on the first; it is told
to drain, every call moves to the second (``MoshiEngine.export_slot`` / ``import_slot`` under the
server's move), its client follows ``session.moved``, and each call's audio and text equal what a
third replica, never drained, answers to the same input: every frame exactly once, the model
going on where it was.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import numpy as np
import pytest
import websockets

from tests.resume_client import ResumingClient
from tests.test_live_migration import replicas
from tests.test_resume_forward import SECRET

pytest.importorskip("moshi")

CALLS = 64
FRAMES = 30
GAP_S = 0.05
MOVING_GAP_S = 0.15  # once the drain comes: the calls stay live while all 64 move
MOSHI = ("--engine", "moshi", "--moshi-preset", "tiny", "--moshi-greedy", "--moshi-dtype", "float64",
         "--moshi-threads", "1", "--resume-grace-s", "60", "--max-sessions-per-client", "0",
         "--max-detached", "80", "--max-sessions", str(CALLS + 2), "--log-level", "info")  # fmt: skip


def chunks(seed: int) -> list[bytes]:
    audio = np.random.default_rng(seed).standard_normal((FRAMES, 1920)) * 0.1
    return [row.astype(np.float32).tobytes() for row in audio]


async def call(
    seed: int, url: str, fleet: str, started: list[int], streaming: asyncio.Event
) -> ResumingClient:
    """One call paced at ``GAP_S``, then input.end; a move is followed at ``fleet``. Past its
    sixth frame it waits for ``streaming``: every call is live when the drain comes."""
    client = ResumingClient(url, chunks(seed))
    await client.open()
    while True:
        try:
            while client.sent_frames < FRAMES:
                await client.send(client.sent_frames + 1)
                if client.sent_frames == 6 and not client.resumed:
                    started[0] += 1
                    if started[0] == CALLS:
                        streaming.set()
                    await streaming.wait()
                await asyncio.sleep(MOVING_GAP_S if streaming.is_set() else GAP_S)
            await client.finish(timeout=240)
        except websockets.ConnectionClosed:
            await client.wait_closed(timeout=240)
        if client.close_code != 1012:
            return client
        first = await client.follow(fleet)
        assert first["type"] == "session.resumed", first


def answer(client: ResumingClient) -> tuple[list[bytes], dict[int, str]]:
    """The call's audio, frame by frame, and its text by frame (a replay's repeat counted once)."""
    closed = client.closed
    assert client.close_code == 1000 and closed and closed["reason"] == "completed", client.events[-3:]
    texts = {e["frame"]: e["text"] for e in client.events if e["type"] == "text.delta"}
    return client.frames, texts


def test_a_drain_moves_64_moshi_calls_and_each_answers_as_if_unmoved(server_factory, monkeypatch) -> None:
    source, target, unmoved = replicas(
        server_factory, monkeypatch,
        ("MOVER", "--move-timeout-s", "60", "--drain-grace-s", "120", *MOSHI),
        ("--peer-secret", SECRET, *MOSHI),
        MOSHI,
    )  # fmt: skip

    async def main() -> tuple[list[ResumingClient], list[ResumingClient]]:
        streaming, started = asyncio.Event(), [0]
        moved = [asyncio.create_task(call(s, source.ws(), target.ws(), started, streaming))
                 for s in range(CALLS)]
        await asyncio.wait_for(streaming.wait(), 240)
        source.proc.send_signal(signal.SIGTERM)
        clients = await asyncio.wait_for(asyncio.gather(*moved), 400)
        assert await asyncio.to_thread(source.proc.wait, 60) == 0
        streaming, started = asyncio.Event(), [0]
        calls = (call(s, unmoved.ws(), "", started, streaming) for s in range(CALLS))
        reference = await asyncio.gather(*calls)
        return clients, reference

    clients, reference = asyncio.run(main())
    for seed, (client, ref) in enumerate(zip(clients, reference, strict=True)):
        assert len(client.moved) == 1 and not ref.moved, (seed, client.events[-3:])
        got, want = answer(client), answer(ref)
        assert len(got[0]) == len(want[0]), seed
        assert got[0] == want[0], f"call {seed}: audio differs from frame {_difference(got[0], want[0])}"
        assert got[1] == want[1], f"call {seed}: text {got[1]} != {want[1]}"
    assert any(answer(ref)[1] for ref in reference), "no text event: the text path was not exercised"
    log = source.log()
    assert f"drain: moved {CALLS} of {CALLS} sessions" in log, log[-3000:]
    assert "Traceback" not in log and "Traceback" not in target.log()


def _difference(a: list[Any], b: list[Any]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
