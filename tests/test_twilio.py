"""Twilio Media Streams at /v1/twilio over real sockets, with a client that behaves like Twilio."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import Iterator

import numpy as np
import pytest
import websockets

from duplexserve.codecs import g711
from tests.conftest import ServerProcess, start_server
from tests.twilio_client import CHUNK, FakeTwilio

RATE = 8000
FRAME = 640  # 80 ms of mu-law at 8 kHz: one model frame


@pytest.fixture(scope="module")
def tw_server(tmp_path_factory) -> Iterator[ServerProcess]:
    folder = str(tmp_path_factory.mktemp("twilio"))
    server = start_server(folder, "--max-sessions", "80", "--log-level", "info")  # info: call summaries
    yield server
    server.stop()


def run(coro):
    return asyncio.run(coro)


def wait_logged(server: ServerProcess, line: str, timeout_s: float = 30.0) -> None:
    """The call summary is logged as the connection ends, a moment after the client sees it."""
    deadline = time.monotonic() + timeout_s
    while line not in server.log():
        assert time.monotonic() < deadline, f"never logged: {line!r}"
        time.sleep(0.05)


def speech(seconds: float, seed: int = 0) -> bytes:
    """Tones in the telephone band, as mu-law: every call's own, loud enough to survive G.711."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    x = sum(0.15 * np.sin(2 * np.pi * rng.uniform(200, 3000) * t + rng.uniform(0, 6)) for _ in range(4))
    return g711.f32_to_ulaw(np.asarray(x, dtype=np.float32))


def linear(mulaw: bytes) -> np.ndarray:
    return g711.ULAW_TO_S16[np.frombuffer(mulaw, np.uint8)].astype(np.float64)


def aligned(sent: bytes, got: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Input and output lined up by cross-correlation (the resamplers' delay), as 16-bit values."""
    a, b = linear(sent), linear(got)
    lag = int(np.argmax(np.correlate(b, a[:4000], "valid")))
    n = min(len(a), len(b) - lag)
    return a[:n], b[lag : lag + n]


def within_quantisation(a: np.ndarray, b: np.ndarray) -> None:
    """Every sample within one mu-law step of the input at its level, plus 128 (-48 dBFS) for the
    ripple of the two resamplers (8 -> 24 -> 8 kHz); the first 10 ms, where the filters settle
    on an input that starts at full level, are left out."""
    codes = g711.S16_TO_ULAW[a.astype(np.int16).view(np.uint16)]
    step = 8 << ((~codes.astype(np.int32) >> 4) & 7)  # the quantisation step at that level
    settle = 80
    excess = (np.abs(b - a) - step)[settle:]
    assert np.all(excess <= 128), float(np.max(excess))
    a, b = a[settle:], b[settle:]
    snr = 10 * np.log10(np.sum(a**2) / np.sum((a - b) ** 2))
    assert snr > 40, snr


async def call(url: str, audio: bytes, **kwargs) -> FakeTwilio:
    """A whole call: the audio, every answer back, then stop."""
    twilio = FakeTwilio(url, **kwargs)
    await twilio.open()
    await twilio.send_audio(audio)
    await twilio.wait_audio(len(audio) // FRAME * FRAME - FRAME)  # soxr holds back a little
    await twilio.stop()
    await twilio.wait_closed()
    return twilio


def test_whole_exchange_echoes_the_caller_and_marks_every_answer(tw_server):
    audio = speech(2.0)
    before = tw_server.metrics()
    twilio = run(call(tw_server.ws("/v1/twilio"), audio))
    got = twilio.received
    assert got.close_code == 1000
    assert set(got.events()) == {"media", "mark"}, got.events()[:10]
    for message in got.messages:
        assert message["streamSid"] == twilio.stream_sid
    media = [m for m in got.messages if m["event"] == "media"]
    for m in media:
        assert set(m) == {"event", "streamSid", "media"} and set(m["media"]) == {"payload"}
        size = len(base64.b64decode(m["media"]["payload"]))
        assert size and size % CHUNK == 0, size  # whole 20 ms multiples
    # a mark follows every media message, and names are all different
    kinds = got.events()
    assert all(kinds[i + 1] == "mark" for i, k in enumerate(kinds) if k == "media")
    assert len(set(got.marks)) == len(got.marks) == len(media)
    # every frame the caller completed comes back, as an echo of what the caller said
    assert len(got.audio) >= len(audio) - FRAME and len(got.audio) % FRAME == 0
    within_quantisation(*aligned(audio, bytes(got.audio)))
    after = tw_server.metrics()
    echoed = after["duplexserve_twilio_marks_echoed_total"] - before["duplexserve_twilio_marks_echoed_total"]
    assert echoed == len(got.marks)
    assert after["duplexserve_twilio_calls_total"] - before["duplexserve_twilio_calls_total"] == 1


def test_paced_call_with_dtmf_and_stop_ends_with_counts(tw_server):
    audio = speech(1.0, seed=3)

    async def main() -> FakeTwilio:
        twilio = FakeTwilio(tw_server.ws("/v1/twilio"))
        await twilio.open()
        await twilio.send_audio(audio[: len(audio) // 2], pace_s=0.02)  # in real time, as Twilio
        await twilio.send_dtmf("5")
        await twilio.send_audio(audio[len(audio) // 2 :], pace_s=0.02)
        await twilio.wait_audio(len(audio) // FRAME * FRAME - FRAME)
        await twilio.stop()
        await twilio.wait_closed()
        return twilio

    twilio = run(main())
    assert twilio.received.close_code == 1000
    within_quantisation(*aligned(audio, bytes(twilio.received.audio)))
    frames = len(twilio.received.audio) // FRAME
    ended = f"call {twilio.call_sid} ended (client_closed): frames in {frames}, out {frames}, dropped 0"
    wait_logged(tw_server, ended)


def test_sixty_four_calls_at_once_each_hear_their_own_echo(tw_server):
    async def main() -> list[tuple[bytes, FakeTwilio]]:
        audios = [speech(1.0, seed=100 + i) for i in range(64)]
        calls = await asyncio.gather(*(call(tw_server.ws("/v1/twilio"), a) for a in audios))
        return list(zip(audios, calls, strict=True))

    for audio, twilio in run(main()):
        assert twilio.received.close_code == 1000
        within_quantisation(*aligned(audio, bytes(twilio.received.audio)))


def test_session_that_ends_with_audio_queued_at_twilio_sends_clear(server_factory):
    server = server_factory("--max-session-s", "1")

    async def main() -> FakeTwilio:
        twilio = FakeTwilio(server.ws("/v1/twilio"), echo_marks=False)  # nothing has played yet
        await twilio.open()
        await twilio.send_audio(speech(0.5))
        await twilio.wait_audio(FRAME)
        await twilio.wait_closed(timeout=30)
        return twilio

    got = run(main()).received
    assert got.events()[-1] == "clear" and got.clears == 1
    assert got.close_code == 1000
    assert server.metrics()["duplexserve_twilio_clears_sent_total"] == 1


def test_api_key_as_custom_parameter_or_in_the_url(server_factory):
    server = server_factory("--api-keys", "k1,k2")
    audio = speech(0.5)

    async def refused(url: str, custom: dict[str, str]) -> int | None:
        twilio = FakeTwilio(url, custom)
        await twilio.open()
        return (await twilio.wait_closed()).close_code

    by_param = run(call(server.ws("/v1/twilio"), audio, custom={"token": "k2", "FirstName": "Jane"}))
    assert by_param.received.close_code == 1000 and len(by_param.received.audio) >= FRAME * 5
    by_url = run(call(server.ws("/v1/twilio", "token=k1"), audio))
    assert by_url.received.close_code == 1000 and len(by_url.received.audio) >= FRAME * 5
    assert run(refused(server.ws("/v1/twilio"), {})) == 1008
    assert run(refused(server.ws("/v1/twilio"), {"token": "wrong"})) == 1008
    assert "k2" not in server.log() and "k1" not in server.log()


def test_custom_parameters_go_to_the_engine_typed(tw_server):
    async def closed_with(custom: dict[str, str]) -> int | None:
        twilio = FakeTwilio(tw_server.ws("/v1/twilio"), custom)
        with contextlib.suppress(websockets.ConnectionClosed):  # a refused call is closed at once
            await twilio.open()
            await twilio.send_audio(speech(0.2))
            await twilio.stop()
        return (await twilio.wait_closed()).close_code

    assert run(closed_with({"seed": "42", "text_prompt": "You are a receptionist."})) == 1000
    assert run(closed_with({"seed": "forty-two"})) == 1008  # a typed parameter that does not parse
    assert "query parameter seed must be int" in tw_server.log()


def test_full_server_refuses_the_call(server_factory):
    server = server_factory("--max-sessions", "1")

    async def main() -> int | None:
        first = FakeTwilio(server.ws("/v1/twilio"))
        await first.open()
        await first.send_audio(speech(0.2))
        await first.wait_audio(FRAME)
        second = FakeTwilio(server.ws("/v1/twilio"))
        try:
            with contextlib.suppress(websockets.ConnectionClosed):
                await second.open()
            code = (await second.wait_closed()).close_code
        finally:
            await first.stop()
            await first.wait_closed()
        return code

    assert run(main()) == 1013


def test_a_dropped_socket_ends_the_call_with_its_counts(tw_server):
    async def main() -> FakeTwilio:
        twilio = FakeTwilio(tw_server.ws("/v1/twilio"))
        await twilio.open()
        await twilio.send_audio(speech(3.0, seed=9))  # still answering when the line dies
        await twilio.wait_audio(FRAME)
        twilio._ws.transport.abort()  # the line goes dead: no stop, no close frame
        return twilio

    twilio = run(main())
    wait_logged(tw_server, f"call {twilio.call_sid} ended (disconnected): frames in")
