"""Bad input on /v1/twilio: a log line and a count, the message dropped, the call and others go on.

Twilio has no error message to receive, so the server's log and /metrics are where bad
input shows; a start the server cannot serve ends that call only.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import Iterator

import pytest
import websockets

from tests.conftest import ServerProcess, start_server
from tests.test_twilio import FRAME, aligned, call, speech, within_quantisation
from tests.twilio_client import FakeTwilio

DROPPED = "duplexserve_twilio_messages_dropped_total"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    server = start_server(str(tmp_path_factory.mktemp("twilio-bad")), "--max-sessions", "8")
    yield server
    server.stop()


def dropped(server: ServerProcess, reason: str) -> float:
    return server.metrics().get(f'{DROPPED}{{reason="{reason}"}}', 0.0)


def bad_messages(twilio: FakeTwilio) -> list[tuple[str, dict | str | bytes]]:
    """(reason the server counts it under, the message), one of each kind."""
    good = base64.b64encode(bytes(160)).decode()
    whole = base64.b64encode(bytes(159)).decode()  # no padding: more characters can follow
    return [
        ("invalid_json", '{"event": "media", "media": '),
        ("invalid_json", "hello"),
        ("invalid_event", '["media"]'),
        ("unknown_event", twilio.stamped({"event": "transcription", "text": "hi"})),
        ("invalid_base64", twilio.media("!!not base64!!" + good)),
        ("partial_sample", twilio.media(whole + "AAA")),  # 18 more bits: two bytes and a bit
        ("partial_sample", twilio.media("AAAAA")),
        ("invalid_media", twilio.stamped({"event": "media", "media": {"track": "inbound"}})),
        ("invalid_media", twilio.stamped({"event": "media"})),
        ("binary", good.encode()),
        ("repeated_start", twilio.stamped({"event": "start", "start": {}})),
        ("unknown_mark", twilio.stamped({"event": "mark", "mark": {"name": "someone-else's"}})),
        ("invalid_mark", twilio.stamped({"event": "mark", "mark": {}})),
    ]


def test_each_kind_of_bad_message_is_dropped_and_counted_and_the_call_goes_on(server):
    audio = speech(1.0, seed=7)
    reasons = [reason for reason, _ in bad_messages(FakeTwilio(""))]
    before = {reason: dropped(server, reason) for reason in set(reasons)}

    async def bad_call() -> FakeTwilio:
        twilio = FakeTwilio(server.ws("/v1/twilio"))
        await twilio.open(start=False)
        await twilio.send(twilio.media(base64.b64encode(bytes(160)).decode()))  # media before start
        await twilio.send_start()
        half = len(audio) // 2
        await twilio.send_audio(audio[:half])
        for _, message in bad_messages(twilio):
            await twilio.send(message)
        await twilio.send_audio(audio[half:])
        await twilio.wait_audio(len(audio) // FRAME * FRAME - FRAME)
        await twilio.stop()
        await twilio.wait_closed()
        return twilio

    async def main() -> tuple[FakeTwilio, FakeTwilio]:
        other = asyncio.create_task(call(server.ws("/v1/twilio"), speech(1.0, seed=8)))
        return await bad_call(), await other

    bad, other = asyncio.run(main())
    for twilio, sent in ((bad, audio), (other, speech(1.0, seed=8))):
        assert twilio.received.close_code == 1000
        within_quantisation(*aligned(sent, bytes(twilio.received.audio)))
    assert dropped(server, "before_start") >= 1
    for reason in set(reasons):
        assert dropped(server, reason) - before[reason] == reasons.count(reason), reason
    log = server.log()
    assert "twilio call -: dropped a message (before_start)" in log  # the call is not known yet
    assert f"twilio call {bad.call_sid}: dropped a message (invalid_json)" in log


@pytest.mark.parametrize(
    ("media_format", "code", "reason"),
    [
        ({"encoding": "audio/x-l16", "sampleRate": 16000, "channels": 1}, 1003, "unsupported_format"),
        ({"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 2}, 1003, "unsupported_format"),
    ],
)
def test_a_start_the_server_cannot_serve_ends_that_call(server, media_format, code, reason):
    async def main() -> int | None:
        twilio = FakeTwilio(server.ws("/v1/twilio"))
        with contextlib.suppress(websockets.ConnectionClosed):
            await twilio.open(start=False)
            await twilio.send_start(media_format)
            await twilio.send_audio(speech(0.2))
        return (await twilio.wait_closed()).close_code

    assert asyncio.run(main()) == code
    assert f"twilio call -: {reason}: mediaFormat" in server.log()


def test_start_without_stream_sid_and_a_call_that_never_starts(server):
    async def main() -> tuple[int | None, int | None]:
        broken = FakeTwilio(server.ws("/v1/twilio"))
        with contextlib.suppress(websockets.ConnectionClosed):
            await broken.open(start=False)
            await broken.send({"event": "start", "sequenceNumber": "1", "start": {"callSid": "CA1"}})
        hung_up = FakeTwilio(server.ws("/v1/twilio"))
        await hung_up.open(start=False)
        await hung_up.stop()  # stop before start: nothing to serve
        return (await broken.wait_closed()).close_code, (await hung_up.wait_closed()).close_code

    assert asyncio.run(main()) == (1007, 1000)
    assert "invalid_start: start without a streamSid" in server.log()


def test_a_call_that_never_sends_start_is_closed_after_the_handshake_timeout(server_factory):
    server = server_factory("--handshake-timeout-s", "2")

    async def main() -> int | None:
        twilio = FakeTwilio(server.ws("/v1/twilio"))
        await twilio.open(start=False)  # connected, then nothing
        return (await twilio.wait_closed()).close_code

    assert asyncio.run(main()) == 1008
    assert "no_start: no start event within 2 s" in server.log()
