"""Persona prompts on every protocol, over real sockets: a tiny PersonaPlex behind the real server.

The checkpoint is tests/personaplex_checkpoint.py's (greedy, float64, one session at a
time): a session's answer is a function of its prompt and its input alone, so the same
prompt heard through any protocol's way of carrying it answers the same, and another
prompt answers otherwise. The clients are the real ones or behave like them: websockets
for the native protocol, Kyutai's client's wire handling for ``/api/chat`` (with
PersonaPlex's query fields), the ``openai`` SDK for Realtime. The error cases of
docs/protocol.md too, and ``prompt_unsupported`` on the synthetic echo engine.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import numpy as np
import openai
import pytest
import websockets.asyncio.client

from tests import raw_ws
from tests.conftest import ServerProcess, start_server
from tests.personaplex_checkpoint import CONTEXT, PRESET, write_wav
from tests.test_moshi_equivalence import signal
from tests.test_moshi_protocol import KyutaiLikeClient, voice
from tests.test_realtime_protocol import validate

pytest.importorskip("moshi")

KEY = "sk-persona-key"
FRAMES = 10
FRAME = 1920
PERSONA = {"text_prompt": "hello duplex", "voice_prompt": "voice.pt"}
OTHER = {"text_prompt": "every session"}
connect = websockets.asyncio.client.connect


def run(coro):
    return asyncio.run(coro)


def serve_personaplex(folder: Path, checkpoint: Path, *more: str) -> ServerProcess:
    """PersonaPlex as documented in docs/moshi-engine.md, with its voices and an API key. Every
    output frame counts as speech for Realtime, so each one comes back as a delta."""
    return start_server(
        str(folder), "--engine", "moshi", "--moshi-preset", PRESET, "--moshi-weights", str(checkpoint),
        "--voice-prompt-dir", str(checkpoint / "voices"), "--moshi-context", str(CONTEXT),
        "--moshi-greedy", "--moshi-dtype", "float64", "--moshi-threads", "1", "--max-sessions", "4",
        "--api-keys", KEY, "--realtime-speech-dbfs", "-300", "--model", "personaplex", *more,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pp_server(personaplex_checkpoint, tmp_path_factory):
    server = serve_personaplex(tmp_path_factory.mktemp("pp"), personaplex_checkpoint)
    yield server
    server.stop()


# ----------------------------------------------------------------------------- native duplex/1
async def native(
    server: ServerProcess, query: dict[str, str] | None = None, update: dict[str, Any] | None = None
) -> tuple[list[dict[str, Any]], np.ndarray, int | None]:
    """One session: the prompt in the query or in a session.update (whose session.updated it
    waits for), FRAMES frames of the same input, input.end. Its events, output frames, close code."""
    url = server.ws("/v1/duplex", urlencode({"token": KEY, **(query or {})}))
    events: list[dict[str, Any]] = []
    audio: list[np.ndarray] = []
    async with connect(url, max_size=None) as ws:
        events.append(json.loads(await ws.recv()))
        if events[0]["type"] == "session.created":
            if update is not None:
                await ws.send(json.dumps({"type": "session.update", **update}))
                while events[-1]["type"] not in ("session.updated", "session.closed"):
                    events.append(json.loads(await ws.recv()))
            if events[-1]["type"] != "session.closed":
                await ws.send(signal(5, FRAMES).tobytes())
                await ws.send(json.dumps({"type": "input.end"}))
        with contextlib.suppress(websockets.ConnectionClosedError):  # a close other than 1000
            async for message in ws:
                if isinstance(message, bytes):
                    audio.append(np.frombuffer(message, np.float32))
                else:
                    events.append(json.loads(message))
    frames = np.stack(audio) if audio else np.zeros((0, FRAME), np.float32)
    return events, frames, ws.close_code


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


def test_native_prompt_in_the_query_or_the_first_update_answers_by_its_prompt(pp_server):
    events, by_query, code = run(native(pp_server, PERSONA))
    assert events[0]["type"] == "session.created" and events[0]["engine"] == "moshi"
    assert "error" not in kinds(events) and code == 1000
    closed = events[-1]
    assert closed["type"] == "session.closed" and closed["reason"] == "completed"
    assert closed["frames_in"] == FRAMES and len(by_query) == closed["frames_out"] > FRAMES
    assert np.abs(by_query).max() > 0

    events, by_update, _ = run(native(pp_server, update=PERSONA))
    assert kinds(events)[:2] == ["session.created", "session.updated"] and "error" not in kinds(events)
    np.testing.assert_array_equal(by_update, by_query)  # the same prompt, the same answer
    _, again, _ = run(native(pp_server, PERSONA))
    np.testing.assert_array_equal(again, by_query)
    _, other, _ = run(native(pp_server, OTHER))
    _, unprompted, _ = run(native(pp_server))  # the engine's default prompt
    assert other.shape == by_query.shape and not np.array_equal(other, by_query)
    assert not np.array_equal(unprompted, by_query) and not np.array_equal(unprompted, other)


@pytest.mark.parametrize("ws", ["fast", "websockets-sansio"])
def test_native_prompt_is_set_once_and_audio_before_session_updated_is_not_accepted(
    pp_server, personaplex_checkpoint, tmp_path, ws
):
    server = pp_server if ws == "fast" else serve_personaplex(tmp_path, personaplex_checkpoint, "--ws", ws)
    try:
        refused_while_prompting(server)
    finally:
        if server is not pp_server:
            server.stop()


def refused_while_prompting(server: ServerProcess) -> None:
    sock, rest = raw_ws.connect(server.port, f"/v1/duplex?token={KEY}")
    reader = raw_ws.Reader(sock, rest)
    try:
        assert json.loads(reader.next()[1])["type"] == "session.created"
        update = json.dumps({"type": "session.update", **PERSONA}).encode()
        early = signal(6, 2).tobytes()
        # One write: the server reads the audio while the prompt runs on the engine.
        sock.sendall(raw_ws.frame(0x81, update) + raw_ws.frame(0x82, early))
        refused, updated = (json.loads(reader.next()[1]) for _ in range(2))
        assert refused["type"] == "error" and refused["code"] == "prompt_running" and not refused["fatal"]
        assert updated["type"] == "session.updated"
        sock.sendall(raw_ws.frame(0x81, json.dumps({"type": "session.update", **OTHER}).encode()))
        locked = json.loads(reader.next()[1])
        assert locked["code"] == "session_locked" and not locked["fatal"]
        end = raw_ws.frame(0x81, b'{"type": "input.end"}')
        sock.sendall(raw_ws.frame(0x82, signal(5, 2).tobytes()) + end)
        frames, code = reader.until_close()
        closed = json.loads(frames[-1][1])
        assert closed["type"] == "session.closed" and closed["frames_in"] == 2 and code == 1000
    finally:
        sock.close()


def test_native_session_updated_echoes_the_prompt_the_model_ran(pp_server, echo_server):
    events, _, _ = run(native(pp_server, update=PERSONA))
    assert events[1]["type"] == "session.updated", events
    assert (events[1]["text_prompt"], events[1]["voice_prompt"]) == ("hello duplex", "voice.pt")
    events, _, _ = run(native(pp_server, update=OTHER))
    assert (events[1]["text_prompt"], events[1]["voice_prompt"]) == ("every session", "")
    # A prompt from the query, then an update of the formats only: still the prompt applied.
    events, _, _ = run(native(pp_server, PERSONA, update={"output": {"format": "pcm_f32le"}}))
    assert events[1]["type"] == "session.updated" and events[1]["voice_prompt"] == "voice.pt"
    # A model without prompts ran none: nothing to echo (and prompt_unsupported said so).
    events, _, _ = run(native(echo_server, update=PERSONA))
    updated = next(e for e in events if e["type"] == "session.updated")
    assert "text_prompt" not in updated and "voice_prompt" not in updated


def test_the_tiny_preset_takes_a_persona_out_of_the_box(server_factory, tmp_path):
    """A persona on a laptop: no checkpoint, no --moshi-tokenizer (every text prompt was refused
    with invalid_prompt), a .wav of one's own as the voice; the toy tokenizer's text streams."""
    (tmp_path / "voices").mkdir()
    write_wav(tmp_path / "voices" / "mine.wav", 0.5 * signal(99, 5).reshape(-1))
    server = server_factory("--engine", "moshi", "--moshi-preset", PRESET, "--device", "cpu",
                            "--moshi-threads", "1", "--max-sessions", "1", "--api-keys", KEY,
                            "--voice-prompt-dir", str(tmp_path / "voices"))
    events, audio, code = run(native(server, {"text_prompt": "You enjoy a good conversation.",
                                              "voice_prompt": "mine.wav"}))
    assert "error" not in kinds(events) and code == 1000, events
    assert events[-1]["reason"] == "completed" and len(audio) == events[-1]["frames_out"] > FRAMES
    assert any(e["type"] == "text.delta" and e["text"] for e in events), events


def test_native_unknown_voice_and_bad_prompt_close_the_session(pp_server):
    events, audio, code = run(native(pp_server, {"voice_prompt": "NATF9.pt"}))
    assert kinds(events) == ["error"] and events[0]["code"] == "voice_not_found" and code == 1008
    assert "NATF9.pt" in events[0]["message"] and events[0]["fatal"] and not len(audio)
    events, _, code = run(native(pp_server, update={"voice_prompt": "NATF9.pt"}))
    assert kinds(events) == ["session.created", "error", "session.closed"] and code == 1008
    assert events[1]["code"] == events[2]["reason"] == "voice_not_found"
    events, _, code = run(native(pp_server, update={"text_prompt": 42}))
    assert events[1]["code"] == "invalid_event" and code == 1007
    long_prompt = {"text_prompt": " ".join(["hello duplex engine"] * CONTEXT)}  # past the context
    events, _, code = run(native(pp_server, long_prompt))
    assert kinds(events) == ["error"] and events[0]["code"] == "invalid_prompt" and code == 1007


def test_a_model_without_prompts_says_prompt_unsupported_and_goes_on(echo_server):
    x = signal(7, 4)

    async def go(first: dict[str, Any] | None) -> tuple[list[dict[str, Any]], bytes]:
        url = echo_server.ws("/v1/duplex", urlencode(PERSONA if first is None else {}))
        events, audio = [], b""
        async with connect(url) as ws:
            events.append(json.loads(await ws.recv()))
            if first is not None:
                await ws.send(json.dumps(first))
            events.append(json.loads(await ws.recv()))
            await ws.send(x.tobytes())
            await ws.send(json.dumps({"type": "input.end"}))
            async for message in ws:
                if isinstance(message, bytes):
                    audio += message
                elif json.loads(message)["type"] != "text.delta":
                    events.append(json.loads(message))
        return events, audio

    for first in (None, {"type": "session.update", **PERSONA}):
        events, audio = run(go(first))
        assert events[0]["type"] == "session.created"
        assert events[1]["type"] == "error" and events[1]["code"] == "prompt_unsupported"
        assert not events[1]["fatal"] and audio == x.tobytes()  # the echo, unchanged
        assert events[-1]["reason"] == "completed" and events[-1]["frames_in"] == 4
        if first is not None:
            assert kinds(events)[2] == "session.updated"


# ------------------------------------------------------------------------- Kyutai's /api/chat
async def moshi_chat(server: ServerProcess, query: dict[str, str], pcm: np.ndarray) -> Any:
    url = server.ws("/api/chat", urlencode({"worker_auth_id": KEY, **query}))
    async with connect(url, max_size=None) as ws:
        client = KyutaiLikeClient(ws)
        try:
            await client.wait_handshake()
        except websockets.ConnectionClosed:
            client.result.close_code = ws.close_code
            return client.result
        await client.send_pcm(pcm)
        await client.read_until(len(pcm) - FRAME)
        return client.result


def test_moshi_chat_takes_the_prompt_as_personaplexs_client_sends_it(pp_server):
    pcm = voice(FRAMES)
    first = run(moshi_chat(pp_server, PERSONA, pcm))
    assert first.handshake[:1] == b"\x00" and first.errors == []
    n = len(pcm) - FRAME
    again = run(moshi_chat(pp_server, PERSONA, pcm))
    np.testing.assert_array_equal(again.pcm[:n], first.pcm[:n])
    other = run(moshi_chat(pp_server, OTHER, pcm))
    assert not np.array_equal(other.pcm[:n], first.pcm[:n])
    refused = run(moshi_chat(pp_server, {"voice_prompt": "NATF9.pt"}, pcm))
    assert refused.handshake == b"" and refused.close_code == 1008
    assert len(refused.errors) == 1 and refused.errors[0].startswith("voice_not_found")


def test_moshi_chat_without_prompts_says_so_after_the_handshake(echo_server):
    pcm = voice(5)
    res = run(moshi_chat(echo_server, {"text_prompt": "be brief"}, pcm))
    assert res.handshake and len(res.errors) == 1 and res.errors[0].startswith("prompt_unsupported")
    assert len(res.pcm) >= len(pcm) - FRAME  # the session went on


# ---------------------------------------------------------------------------- OpenAI Realtime
def pcm16(frames: int) -> bytes:
    return (np.clip(signal(5, frames).reshape(-1), -1, 1) * 32767).astype("<i2").tobytes()


async def realtime(
    server: ServerProcess,
    session: dict[str, Any],
    wait: bool = True,
    later: dict[str, Any] | None = None,
    frames: int = FRAMES,
) -> tuple[list[dict[str, Any]], bytes]:
    """The openai SDK: session.update (waiting for session.updated, or straight on with the
    audio), ``frames`` frames appended, the deltas of as many frames read; ``later``: a second
    session.update once audio came back."""
    client = openai.AsyncOpenAI(base_url=server.http + "/v1", api_key=KEY)
    events: list[dict[str, Any]] = []
    audio = b""
    async with asyncio.timeout(60), client.realtime.connect(model="personaplex") as conn:
        events.append(validate(await conn.recv_bytes()))
        await conn.session.update(session={"type": "realtime", **session})
        while wait and events[-1]["type"] != "session.updated":
            events.append(validate(await conn.recv_bytes()))
        data = pcm16(frames)
        for i in range(0, len(data), 4800):  # 100 ms appends
            await conn.input_audio_buffer.append(audio=base64.b64encode(data[i : i + 4800]).decode())
        while len(audio) < frames * FRAME * 2:
            event = validate(await conn.recv_bytes())
            events.append(event)
            if event["type"] == "response.output_audio.delta":
                audio += base64.b64decode(event["delta"])
                if later is not None:
                    await conn.session.update(session={"type": "realtime", **later})
                    later = None
    return events, audio[: frames * FRAME * 2]


PERSONA_RT = {"instructions": PERSONA["text_prompt"], "audio": {"output": {"voice": "voice.pt"}}}


def test_realtime_instructions_and_voice_are_the_prompt_with_the_openai_sdk(pp_server):
    events, audio = run(realtime(pp_server, PERSONA_RT))
    updated = next(e for e in events if e["type"] == "session.updated")["session"]
    assert updated["instructions"] == "hello duplex" and updated["audio"]["output"]["voice"] == "voice.pt"
    assert "error" not in kinds(events) and len(audio) == FRAMES * FRAME * 2
    # The audio sent straight after the update waited for its prompt: the same answer.
    events, straight_on = run(realtime(pp_server, PERSONA_RT, wait=False))
    assert kinds(events).index("session.updated") < kinds(events).index("response.output_audio.delta")
    assert straight_on == audio
    # The beta flat voice is the same voice prompt; other instructions answer otherwise.
    _, beta = run(realtime(pp_server, {"instructions": "hello duplex", "voice": "voice.pt"}))
    assert beta == audio
    # (the tiny model's greedy answers to two prompts may part only some frames in: with
    # sentencepiece 0.2.3's tokenizer of these two, at the 12th; so a longer exchange each)
    _, longer = run(realtime(pp_server, PERSONA_RT, frames=3 * FRAMES))
    _, other = run(realtime(pp_server, {"instructions": OTHER["text_prompt"]}, frames=3 * FRAMES))
    assert longer[: len(audio)] == audio and other != longer


def test_realtime_a_later_change_is_session_locked_and_the_session_goes_on(pp_server):
    events, audio = run(realtime(pp_server, PERSONA_RT, later={"instructions": "something else"}))
    locked = [e for e in events if e["type"] == "error"]
    assert len(locked) == 1 and locked[0]["error"]["code"] == "session_locked"
    assert locked[0]["error"]["param"] == "session.instructions"
    assert len(audio) == FRAMES * FRAME * 2  # still answered after the refusal
    # Audio first: the default prompt ran; instructions after it are refused.
    events, _ = run(realtime(pp_server, {}, later={"audio": {"output": {"voice": "voice.wav"}}}))
    assert [e["error"]["code"] for e in events if e["type"] == "error"] == ["session_locked"]


def test_realtime_unknown_voice_is_an_error_then_1008(pp_server):
    async def go() -> tuple[list[dict[str, Any]], int | None]:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with connect(pp_server.ws("/v1/realtime"), additional_headers=headers) as ws:
            events = [validate(await ws.recv())]
            await ws.send(json.dumps({"type": "session.update", "session": {"voice": "alloy"}}))
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    events.append(validate(await ws.recv()))
            return events, ws.close_code

    events, code = run(go())
    assert kinds(events) == ["session.created", "error"] and code == 1008
    assert events[1]["error"]["code"] == "voice_not_found"


def test_realtime_unknown_voice_is_named_in_realtimes_own_term(pp_server):
    """Realtime calls it the output ``voice``, not the native ``voice_prompt``; and where voices come from."""

    async def go() -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with connect(pp_server.ws("/v1/realtime"), additional_headers=headers) as ws:
            await ws.recv()  # session.created
            await ws.send(json.dumps({"type": "session.update", "session": {"voice": "alloy"}}))
            return json.loads(await ws.recv())

    error = run(go())["error"]
    assert error["message"] == ("voice 'alloy' is not one of this server's voices: GET /v1/voices lists "
                                "them (its --voice-prompt-dir)")


# ------------------------------------------------------------------------ voices and metrics
def test_voices_are_listed_with_the_key(pp_server, echo_server):
    assert httpx.get(pp_server.http + "/v1/voices").status_code == 401
    listed = httpx.get(pp_server.http + "/v1/voices", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert listed == {
        "object": "list",
        "data": [{"id": "voice.pt", "object": "voice"}, {"id": "voice.wav", "object": "voice"}],
    }
    assert httpx.get(echo_server.http + "/v1/voices").json() == {"object": "list", "data": []}


def test_time_to_ready_and_prompt_outcomes_are_exported(pp_server):
    run(native(pp_server, PERSONA))
    run(native(pp_server, {"voice_prompt": "NATF9.pt"}))
    metrics = pp_server.metrics()
    assert metrics['duplexserve_prompts_total{outcome="ran",protocol="duplex/1"}'] >= 1
    assert metrics['duplexserve_prompts_total{outcome="voice_not_found",protocol="duplex/1"}'] >= 1
    assert metrics['duplexserve_session_ready_seconds_count{protocol="duplex/1"}'] >= 1
    assert metrics['duplexserve_prompt_seconds_count{protocol="duplex/1"}'] >= 1


def test_load_generator_reports_time_to_ready_with_prompts(pp_server):
    from duplexserve.loadgen.runner import LoadSpec, run_load

    for protocol, formats in (
        ("native", {}),
        ("moshi", {"input_format": "opus", "output_format": "opus"}),
        ("realtime", {"input_format": "pcm_s16le", "output_format": "pcm_s16le"}),
    ):
        spec = LoadSpec(
            url=f"ws://127.0.0.1:{pp_server.port}?token={KEY}", protocol=protocol, concurrency=2,
            sessions=3, frames=6, message_ms=160, paced=False, expect="none", scrape_metrics=False,
            text_prompt="hello duplex", voice_prompt="voice.pt", **formats,
        )  # fmt: skip
        result = run_load(spec)
        assert result.guards_ok, result.failures
        summary = result.summary()
        assert summary["ready_p50_ms"] > 0 and summary["ready_max_ms"] >= summary["ready_p99_ms"]
        assert all(s.ready_s > 0 for s in result.sessions)



def test_load_generator_gives_each_session_its_own_prompt_on_request():
    """`{session}` in --text-prompt becomes the session's number: every prompt new to the server."""
    from duplexserve.loadgen.runner import LoadSpec

    spec = LoadSpec(url="ws://x", text_prompt="Caller {session}. Help them.", voice_prompt="voice.pt")
    assert spec.prompt(7) == {"text_prompt": "Caller 7. Help them.", "voice_prompt": "voice.pt"}
    assert spec.prompt(8)["text_prompt"] != spec.prompt(7)["text_prompt"]
    assert LoadSpec(url="ws://x", text_prompt="same").prompt(3) == {"text_prompt": "same"}
