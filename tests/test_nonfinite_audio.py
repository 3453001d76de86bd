"""Float32 audio that is not audio (NaN, infinities, 3e38) is refused at the edge.

A real server and real clients: a ``pcm_f32le`` message holding such a sample ends its
session with ``invalid_audio`` and close 1003 (docs/protocol.md), counted in
``duplexserve_audio_refused_total``, while a session beside it on the same server goes on
byte for byte. Over the WebSocket fast path and uvicorn's ASGI path, at the model's rate
(the zero-copy view) and at 48 kHz (refused before the resampler). Values up to the bound
(codecs/pcm.py, ``MAX_NORM``) pass untouched. The engine side of the same fault, a slot
whose last session fed such samples to the model, is tests/test_nonfinite_reset.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import numpy as np
import pytest
import websockets.asyncio.client

from duplexserve.codecs.pcm import MAX_NORM, SampleRangeError, f32_view
from tests.native_client import converse, signal

FRAME_BYTES = 1920 * 4
BAD = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf, "3e38": 3e38, "-3e38": -3e38}


def poisoned(value: float, rate: int = 24000) -> bytes:
    """Two 80 ms frames of quiet noise with ``value`` at one sample of the second."""
    audio = signal(2, seed=5, samples=rate * 80 // 1000) * np.float32(0.1)
    audio[len(audio) // 2 + 17] = value
    return audio.tobytes()


async def _refused(url: str, message: bytes) -> tuple[list[dict], int | None]:
    async with websockets.asyncio.client.connect(url, compression=None, max_size=None) as ws:
        await ws.recv()  # session.created
        await ws.send(message)
        events = []
        with contextlib.suppress(websockets.ConnectionClosed):
            async for msg in ws:
                if isinstance(msg, str):
                    events.append(json.loads(msg))
        return events, ws.close_code


def _check_refused(events: list[dict], close_code: int | None) -> dict:
    errors = [e for e in events if e["type"] == "error"]
    assert len(errors) == 1 and errors[0]["code"] == "invalid_audio" and errors[0]["fatal"] is True, events
    assert close_code == 1003
    assert events[-1]["type"] == "session.closed" and events[-1]["reason"] == "invalid_audio"
    return errors[0]


@pytest.mark.parametrize("ws_impl", ["fast", "websockets-sansio"])
def test_non_finite_and_huge_float32_is_refused_and_the_others_go_on(server_factory, ws_impl):
    server = server_factory("--ws", ws_impl)
    clean = signal(30, seed=1).tobytes()

    async def scenario() -> tuple[list, object]:
        bystander = asyncio.create_task(converse(
            server.ws(), [clean[i : i + FRAME_BYTES] for i in range(0, len(clean), FRAME_BYTES)], gap=0.02
        ))  # fmt: skip
        outcomes = []
        for name, value in BAD.items():
            outcomes.append((name, *await _refused(server.ws(), poisoned(value))))
        outcomes.append(("48k-nan", *await _refused(
            server.ws(query="input_format=pcm_f32le&input_sample_rate=48000"), poisoned(np.nan, 48000)
        )))  # fmt: skip
        return outcomes, await bystander

    outcomes, bystander = asyncio.run(scenario())
    for name, events, close_code in outcomes:
        error = _check_refused(events, close_code)
        expected = "finite" if "inf" in name or "nan" in name else "L2 norm"
        assert expected in error["message"], (name, error)
    assert b"".join(bystander.frames) == clean and bystander.closed["reason"] == "completed"
    metrics = server.metrics()
    assert metrics['duplexserve_audio_refused_total{reason="non_finite"}'] == 4
    assert metrics['duplexserve_audio_refused_total{reason="too_large"}'] == 2
    assert server.log().count("closed for its audio") == 6


def test_loud_but_bounded_float32_passes_untouched(echo_server):
    """Out of [-1, 1] but within the bound: served as sent (the echo returns the bytes)."""
    audio = signal(2, seed=7)
    audio[100], audio[2000] = 1000.0, -MAX_NORM / 2
    res = asyncio.run(converse(echo_server.ws(), [audio.tobytes()]))
    assert b"".join(res.frames) == audio.tobytes() and res.closed["reason"] == "completed"


def test_the_bound_is_the_messages_norm():
    at = np.zeros(1920, np.float32)
    at[0] = MAX_NORM
    assert f32_view(at.tobytes()).base is not None  # a view, not a copy
    over = np.full(1920, MAX_NORM / 40, np.float32)  # every sample small, the norm over it
    with pytest.raises(SampleRangeError, match="L2 norm"):
        f32_view(over.tobytes())
