"""OpenAI Realtime at /v1/realtime over real sockets, with the official ``openai`` SDK as client.

Every server event is validated against the SDK's own server-event union, so a field
missing or misnamed fails here the way it would fail a strict client (pipecat).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import openai
import pytest
import websockets.asyncio.client
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from duplexserve.codecs import g711

FRAME = 1920  # samples per 80 ms model frame at 24 kHz
SILENCE_FRAMES = 6  # the server's default realtime_silence_ms (480) in frames
KEY = "sk-test-key"
SERVER_EVENT = TypeAdapter(RealtimeServerEvent)

OPENING = [
    "response.created",
    "response.output_item.added",
    "conversation.item.added",
    "response.content_part.added",
]
CLOSING = [
    "response.output_audio.done",
    "response.output_audio_transcript.done",
    "response.content_part.done",
    "response.output_item.done",
    "conversation.item.done",
    "response.done",
]


def run(coro):
    return asyncio.run(coro)


def tone(frames: int, seed: int = 0) -> bytes:
    """pcm16 at 24 kHz, loud enough to count as speech; every frame different."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-8000, 8000, frames * FRAME, dtype=np.int16)
    return x.astype("<i2").tobytes()


def silence(frames: int) -> bytes:
    return bytes(frames * FRAME * 2)


def chunks(pcm: bytes, size: int = 2400 * 2) -> list[str]:
    """100 ms appends, as LiveKit sends them: not aligned with the 80 ms model frames."""
    return [base64.b64encode(pcm[i : i + size]).decode() for i in range(0, len(pcm), size)]


def validate(raw: str | bytes) -> dict[str, Any]:
    """The SDK's server-event union must accept the event; returns it as a dict."""
    parsed = SERVER_EVENT.validate_json(raw)
    event = json.loads(raw)
    assert parsed.type == event["type"]
    assert isinstance(event["event_id"], str) and event["event_id"]
    return event


def responses(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The response-related events grouped per response, in arrival order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        rid = e.get("response_id") or (e.get("response") or {}).get("id")
        if e["type"].startswith("conversation.item.") and e["type"] != "conversation.item.truncated":
            rid = next(
                (
                    k
                    for k, g in groups.items()
                    if any(
                        x.get("item_id") == e["item"]["id"]
                        or (x.get("item") or {}).get("id") == e["item"]["id"]
                        for x in g
                    )
                ),
                None,
            )
        if rid:
            groups.setdefault(rid, []).append(e)
    return list(groups.values())


def check_order(group: list[dict[str, Any]]) -> None:
    """The order LiveKit documents and checks: opening events, deltas, closing events."""
    kinds = [e["type"] for e in group]
    assert kinds[:4] == OPENING, kinds[:6]
    assert kinds[-6:] == CLOSING, kinds[-8:]
    middle = set(kinds[4:-6])
    assert middle <= {"response.output_audio.delta", "response.output_audio_transcript.delta"}, middle
    item_id = group[1]["item"]["id"]
    assert all(e["item_id"] == item_id for e in group if "item_id" in e)
    deltas = "".join(e["delta"] for e in group if e["type"] == "response.output_audio_transcript.delta")
    done = group[-1]["response"]
    assert done["object"] == "realtime.response" and done["output"][0]["id"] == item_id
    assert done["output"][0]["content"][0]["transcript"] == deltas
    assert (
        next(e for e in group if e["type"] == "response.output_audio_transcript.done")["transcript"] == deltas
    )


def audio_of(group: list[dict[str, Any]]) -> bytes:
    return b"".join(base64.b64decode(e["delta"]) for e in group if e["type"] == "response.output_audio.delta")


async def sdk_session(url: str, plan, until, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Connect with the openai SDK, run ``plan(conn, events)``, read until ``until(events)``."""
    client = openai.AsyncOpenAI(base_url=url, api_key=KEY)
    events: list[dict[str, Any]] = []
    async with client.realtime.connect(model="moshi-test") as conn:
        first = validate(await conn.recv_bytes())
        assert first["type"] == "session.created"
        events.append(first)

        async def reader() -> None:
            while not until(events):
                events.append(validate(await conn.recv_bytes()))

        task = asyncio.create_task(reader())
        await plan(conn, events)
        await asyncio.wait_for(task, timeout)
    return events


async def wait_for(events: list[dict[str, Any]], predicate, timeout: float = 20.0) -> None:
    async def poll() -> None:
        while not predicate(events):
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rt_server(tmp_path_factory):
    from tests.conftest import start_server

    server = start_server(str(tmp_path_factory.mktemp("rt")), "--max-sessions", "16", "--api-keys", KEY,
                          "--model", "moshi-test")
    yield server
    server.stop()


def test_openai_sdk_streams_audio_and_gets_one_response_per_stretch_of_speech(rt_server):
    speech = tone(10, seed=1)

    async def plan(conn, events):
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {
                    "input": {"format": {"type": "audio/pcm", "rate": 24000}},
                    "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy"},
                },
                "instructions": "be brief",
            }
        )
        await wait_for(events, lambda ev: "session.updated" in kinds(ev))
        for b64 in chunks(speech + silence(SILENCE_FRAMES + 2)):
            await conn.input_audio_buffer.append(audio=b64)

    events = run(sdk_session(rt_server.http + "/v1", plan, lambda ev: "response.done" in kinds(ev)))
    updated = next(e for e in events if e["type"] == "session.updated")["session"]
    assert updated["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert updated["audio"]["output"]["voice"] == "alloy" and updated["instructions"] == "be brief"
    (group,) = responses(events)
    check_order(group)
    assert group[-1]["response"]["status"] == "completed"
    # The echo engine answers with the very samples sent: 10 frames of speech, then the
    # silent frames that ended the response.
    assert audio_of(group) == speech + silence(SILENCE_FRAMES)
    assert group[-1]["response"]["usage"]["output_token_details"]["audio_tokens"] == 10 + SILENCE_FRAMES
    transcript = group[-1]["response"]["output"][0]["content"][0]["transcript"]
    assert "hello" in transcript


def test_cancel_silences_the_current_stretch_and_the_next_one_opens_a_new_response(rt_server):
    first, later = tone(8, seed=2), tone(4, seed=3)

    async def plan(conn, events):
        for b64 in chunks(first):
            await conn.input_audio_buffer.append(audio=b64)
        await wait_for(events, lambda ev: "response.output_audio.delta" in kinds(ev))
        await conn.response.cancel()
        await wait_for(events, lambda ev: "response.done" in kinds(ev))
        # Still the same stretch of speech: muted. Then silence ends it, and new speech
        # opens a new response.
        for b64 in chunks(tone(6, seed=4) + silence(SILENCE_FRAMES + 1) + later + silence(SILENCE_FRAMES)):
            await conn.input_audio_buffer.append(audio=b64)
        await wait_for(events, lambda ev: kinds(ev).count("response.done") == 2)
        cancelled = next(e for e in events if e["type"] == "response.done")["response"]
        item_id = cancelled["output"][0]["id"]
        await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=80)
        await conn.conversation.item.truncate(item_id="item_nope", content_index=0, audio_end_ms=0)

    def until(ev):
        return (
            kinds(ev).count("response.done") == 2
            and "conversation.item.truncated" in kinds(ev)
            and "error" in kinds(ev)
        )

    events = run(sdk_session(rt_server.http + "/v1", plan, until))
    groups = responses(events)
    assert len(groups) == 2
    cancelled, second = groups
    check_order(cancelled)
    check_order(second)
    done = cancelled[-1]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert done["output"][0]["status"] == "incomplete"
    # Nothing of the muted stretch leaked: no delta between the two responses.
    between = events[events.index(cancelled[-1]) + 1 : events.index(second[0])]
    assert "response.output_audio.delta" not in kinds(between)
    assert audio_of(second) == later + silence(SILENCE_FRAMES)
    truncated = next(e for e in events if e["type"] == "conversation.item.truncated")
    assert truncated["audio_end_ms"] == 80 and truncated["item_id"] == done["output"][0]["id"]
    error = next(e for e in events if e["type"] == "error")["error"]
    assert error["code"] == "item_not_found" and error["type"] == "invalid_request_error"


def test_response_create_opens_a_response_at_once_and_echoes_its_metadata(rt_server):
    async def plan(conn, events):
        await conn.response.create(response={"metadata": {"client_event_id": "abc"}})
        await wait_for(events, lambda ev: "response.created" in kinds(ev))
        await conn.response.create()  # one is active: refused, the session goes on
        await wait_for(events, lambda ev: "error" in kinds(ev))
        for b64 in chunks(tone(3, seed=5) + silence(SILENCE_FRAMES)):
            await conn.input_audio_buffer.append(audio=b64)

    events = run(sdk_session(rt_server.http + "/v1", plan, lambda ev: "response.done" in kinds(ev)))
    created = next(e for e in events if e["type"] == "response.created")["response"]
    assert created["metadata"] == {"client_event_id": "abc"} and created["status"] == "in_progress"
    error = next(e for e in events if e["type"] == "error")["error"]
    assert error["code"] == "conversation_already_has_active_response"
    (group,) = responses(events)
    check_order(group)
    assert audio_of(group) == tone(3, seed=5) + silence(SILENCE_FRAMES)


# ------------------------------------------------------------------------- raw WebSocket clients


async def raw_events(ws, n: int | None = None, until=None, timeout: float = 20.0) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    async def read() -> None:
        while (n is None or len(out) < n) and not (until and until(out)):
            out.append(validate(await ws.recv()))

    await asyncio.wait_for(read(), timeout)
    return out


def append(pcm: bytes) -> str:
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})


def test_browser_subprotocol_key_is_accepted_and_realtime_selected(rt_server):
    async def go():
        url = rt_server.ws("/v1/realtime", "model=moshi-test")
        key = f"openai-insecure-api-key.{KEY}"
        async with websockets.asyncio.client.connect(url, subprotocols=["realtime", key]) as ws:
            assert ws.subprotocol == "realtime"
            (created,) = await raw_events(ws, 1)
            assert created["type"] == "session.created" and created["session"]["model"] == "moshi-test"
        wrong = "openai-insecure-api-key.wrong"
        async with websockets.asyncio.client.connect(url, subprotocols=["realtime", wrong]) as ws:
            assert ws.subprotocol == "realtime"
            (error,) = await raw_events(ws, 1)
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
            return error, ws.close_code

    error, code = run(go())
    assert error["type"] == "error" and error["error"]["code"] == "unauthorized" and code == 1008


def test_bad_input_gets_error_events_and_costs_only_its_session(rt_server):
    headers = {"Authorization": f"Bearer {KEY}"}

    async def go():
        url = rt_server.ws("/v1/realtime")
        async with (
            websockets.asyncio.client.connect(url, additional_headers=headers, max_size=None) as bad,
            websockets.asyncio.client.connect(url, additional_headers=headers) as good,
        ):
            await raw_events(bad, 1)
            await raw_events(good, 1)
            for msg in (
                "{not json",
                "[" * 200_000,  # deeper than Python's stack
                json.dumps({"type": "no.such.event", "event_id": "e1"}),
                json.dumps({"type": "input_audio_buffer.append", "audio": "***"}),
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {"audio": {"input": {"format": {"type": "audio/flac"}}}},
                    }
                ),
                json.dumps({"type": "response.cancel"}),
                b"\x00\x01",
            ):
                await bad.send(msg)
            errors = await raw_events(bad, 7)
            # The session goes on: audio still comes back as a response.
            await bad.send(append(tone(2, seed=6) + silence(SILENCE_FRAMES)))
            after = await raw_events(bad, until=lambda ev: "response.done" in kinds(ev))
            # A message over the size limit is fatal for that session only.
            await bad.send(append(bytes(1 << 20)))
            fatal = await raw_events(bad, until=lambda ev: "error" in kinds(ev))
            with pytest.raises(websockets.ConnectionClosed):
                await bad.recv()
            await good.send(append(tone(2, seed=7) + silence(SILENCE_FRAMES)))
            other = await raw_events(good, until=lambda ev: "response.done" in kinds(ev))
            return errors, after, fatal, bad.close_code, other

    errors, after, fatal, code, other = run(go())
    assert kinds(errors) == ["error"] * 7
    codes = [e["error"]["code"] for e in errors]
    assert codes == [
        "invalid_json",
        "invalid_json",
        "unknown_event",
        "invalid_base64",
        "invalid_value",
        "response_cancel_not_active",
        "invalid_message",
    ]
    assert errors[2]["error"]["event_id"] == "e1"
    assert audio_of(responses(after)[0]) == tone(2, seed=6) + silence(SILENCE_FRAMES)
    assert fatal[-1]["error"]["code"] == "message_too_big" and code == 1009
    assert audio_of(responses(other)[0]) == tone(2, seed=7) + silence(SILENCE_FRAMES)


def test_a_commit_needs_100_ms_of_audio_since_the_last_commit_or_clear(rt_server):
    """As OpenAI's server: less is refused with ``input_audio_buffer_commit_empty`` and the
    session goes on; a refused commit does not clear what was appended."""
    headers = {"Authorization": f"Bearer {KEY}"}
    commit = json.dumps({"type": "input_audio_buffer.commit", "event_id": "c1"})

    async def go() -> list[dict[str, Any]]:
        url = rt_server.ws("/v1/realtime")
        async with websockets.asyncio.client.connect(url, additional_headers=headers) as ws:
            await raw_events(ws, 1)
            for msg in (
                commit,  # nothing appended
                append(bytes(1200 * 2)),  # 50 ms
                commit,
                append(bytes(1440 * 2)),  # 60 ms more: 110 ms since the last commit
                commit,
                commit,  # nothing since
                append(bytes(4800 * 2)),
                json.dumps({"type": "input_audio_buffer.clear"}),
                commit,
            ):
                await ws.send(msg)
            return await raw_events(ws, 6)

    events = run(go())
    assert [e["error"]["code"] if e["type"] == "error" else e["type"] for e in events] == [
        "input_audio_buffer_commit_empty",
        "input_audio_buffer_commit_empty",
        "input_audio_buffer.committed",
        "input_audio_buffer_commit_empty",
        "input_audio_buffer.cleared",
        "input_audio_buffer_commit_empty",
    ]
    assert events[0]["error"]["event_id"] == "c1"
    assert "has 0.00ms" in events[0]["error"]["message"] and "has 50.00ms" in events[1]["error"]["message"]
    assert events[2]["item_id"].startswith("item_")


def test_g711_beta_and_ga_formats_in_one_update(rt_server):
    """Beta flat ``input_audio_format`` and GA nested output format; 8 kHz both ways."""
    t = np.arange(18 * 640) / 8000
    sent = np.where(t < 0.8, 0.3 * np.sin(2 * np.pi * 300 * t), 0.0).astype(np.float32)

    async def go():
        headers = {"Authorization": f"Bearer {KEY}", "OpenAI-Beta": "realtime=v1"}
        url = rt_server.ws("/v1/realtime")
        async with websockets.asyncio.client.connect(url, additional_headers=headers) as ws:
            await raw_events(ws, 1)
            await ws.send(
                json.dumps(
                    {
                        "type": "session.update",
                        "session": {
                            "input_audio_format": "g711_ulaw",
                            "audio": {"output": {"format": {"type": "audio/pcma"}}},
                        },
                    }
                )
            )
            (updated,) = await raw_events(ws, 1)
            ulaw = g711.f32_to_ulaw(sent)
            for i in range(0, len(ulaw), 800):  # 100 ms appends
                await ws.send(
                    json.dumps(
                        {
                            "type": "input_audio_buffer.append",
                            "audio": base64.b64encode(ulaw[i : i + 800]).decode(),
                        }
                    )
                )
            return updated, await raw_events(ws, until=lambda ev: "response.done" in kinds(ev))

    updated, events = run(go())
    audio = updated["session"]["audio"]
    assert audio["input"]["format"] == {"type": "audio/pcmu"} and audio["output"]["format"] == {
        "type": "audio/pcma"
    }
    (group,) = responses(events)
    check_order(group)
    deltas = [base64.b64decode(e["delta"]) for e in group if e["type"] == "response.output_audio.delta"]
    assert all(len(d) == 640 for d in deltas)  # one 80 ms frame at 8 kHz, one byte a sample
    assert 10 + SILENCE_FRAMES <= len(deltas) <= 11 + SILENCE_FRAMES  # the resamplers' delay may add one
    got = g711.alaw_to_f32(b"".join(deltas))[:6400]
    spectrum = np.abs(np.fft.rfft(got * np.hanning(len(got))))
    assert abs(np.argmax(spectrum) * 8000 / len(got) - 300) < 5
    assert 0.8 < np.sqrt((got[800:5600] ** 2).mean()) / np.sqrt((sent[800:5600] ** 2).mean()) < 1.2


def test_full_server_refuses_with_an_error_event_then_1013(server_factory):
    server = server_factory("--max-sessions", "1")

    async def go():
        url = server.ws("/v1/realtime")
        async with websockets.asyncio.client.connect(url) as first:
            await raw_events(first, 1)
            async with websockets.asyncio.client.connect(url, subprotocols=["realtime"]) as second:
                (error,) = await raw_events(second, 1)
                with pytest.raises(websockets.ConnectionClosed):
                    await second.recv()
                return error, second.close_code

    error, code = run(go())
    assert error["error"]["type"] == "server_error" and code == 1013


@pytest.mark.parametrize(("output", "rate"), [("pcm_s16le", 24000), ("g711_ulaw", 8000)])
def test_load_generator_drives_realtime_with_its_guards_held(rt_server, output, rate):
    from duplexserve.loadgen.runner import LoadSpec, run_load

    spec = LoadSpec(
        url=f"ws://127.0.0.1:{rt_server.port}?token={KEY}",
        protocol="realtime",
        concurrency=4,
        sessions=6,
        frames=12,
        message_ms=160,
        paced=False,
        input_format="pcm_s16le",
        output_format=output,
        output_rate=rate,
        scrape_metrics=False,
    )
    result = run_load(spec)
    assert len(result.sessions) == 6
    for session in result.sessions:
        assert session.guards.ok, session.guards.describe()
        assert session.frames_received == 12 and session.closed_reason == "completed"


def test_the_documented_example_works(rt_server):
    from tests.test_moshi_protocol import doc_example

    env = {**os.environ, "DUPLEXSERVE_HTTP": rt_server.http, "DUPLEXSERVE_API_KEY": KEY}
    done = subprocess.run(
        [sys.executable, "-c", doc_example("realtime")], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    # 1 s of tone is 12.5 frames: 13 voiced frames, then the 6 silent ones that end it.
    assert "hello from" in done.stdout and "response completed: 1520 ms of audio" in done.stdout
