"""Property-based attacks: random chunking, random bytes, broken JSON, events out of order.

Whatever a client sends, the server answers with an error from docs/protocol.md's table or
serves it, never crashes, and the next client is served normally.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json

import numpy as np
import websockets.asyncio.client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duplexserve.server.core.session import Limits, Session
from tests.native_client import signal

FATAL = {"invalid_audio": 1003, "invalid_json": 1007, "invalid_event": 1007, "message_too_big": 1009}
NON_FATAL = {"session_locked", "unsupported_format", "unknown_event", "input_ended"}


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=5000), max_size=30))
def test_any_chunking_reassembles_the_same_frames(cuts):
    audio = signal(4, seed=1)
    bounds = sorted({min(c, len(audio)) for c in cuts} | {0, len(audio)})
    s = Session("s", 0, 1, Limits(inflight_frames=100, max_pending_frames=100))
    for a, b in itertools.pairwise(bounds):
        s.receive_audio(audio[a:b])
    frames = s.frames_ready()
    assert s.frames_in == 4 and len(frames) == 4
    assert np.array_equal(np.concatenate(frames), audio)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
event_types = st.sampled_from(["session.update", "input.end", "session.close", "ping", "bogus", "", "ping "])
events = st.builds(
    lambda kind, extra: json.dumps({"type": kind, **extra}),
    event_types,
    st.dictionaries(
        st.sampled_from(["input", "output", "id", "format", "sample_rate"]), json_values, max_size=3
    ),
)
messages = st.one_of(
    st.binary(max_size=9000),  # any length: odd ones are bad audio
    st.text(max_size=200),  # mostly not JSON
    json_values.map(json.dumps),  # JSON, but rarely an event
    events,  # well-formed events with random fields, in random order
    events.map(lambda e: e[: len(e) // 2]),  # truncated
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=st.lists(messages, min_size=1, max_size=8))
def test_random_sessions_get_protocol_answers_and_harm_nobody(echo_server, script):
    async def attack():
        async with websockets.asyncio.client.connect(echo_server.ws(), compression=None, max_size=None) as ws:
            await ws.recv()
            received = []
            with contextlib.suppress(websockets.ConnectionClosed):
                for m in script:
                    await ws.send(m)
                await ws.send(json.dumps({"type": "session.close"}))
                async for msg in ws:
                    if isinstance(msg, str):
                        received.append(json.loads(msg))
            return received, ws.close_code

    async def healthy():
        audio = signal(2, seed=5).tobytes()
        async with websockets.asyncio.client.connect(echo_server.ws(), compression=None) as ws:
            await ws.recv()
            await ws.send(audio)
            await ws.send(json.dumps({"type": "input.end"}))
            return b"".join([m async for m in ws if isinstance(m, bytes)]) == audio

    received, code = asyncio.run(attack())
    for event in received:
        if event["type"] == "error":
            assert event["code"] in FATAL or event["code"] in NON_FATAL, event
            assert event["fatal"] == (event["code"] in FATAL)
    closed = [e for e in received if e["type"] == "session.closed"]
    assert len(closed) == 1
    fatal = [e for e in received if e["type"] == "error" and e["fatal"]]
    if fatal:
        assert code == FATAL[fatal[0]["code"]] and closed[0]["reason"] == fatal[0]["code"]
    else:
        assert code == 1000 and closed[0]["reason"] in ("client_closed", "completed")
    c = closed[0]
    assert c["frames_in"] == c["frames_out"] + c["frames_dropped"]
    assert asyncio.run(healthy())
