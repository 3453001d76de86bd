"""duplex/1 over real sockets against a real server process."""

from __future__ import annotations

import asyncio
import contextlib
import json

import numpy as np
import pytest
import websockets.asyncio.client

from tests.native_client import converse, signal

FRAME_BYTES = 1920 * 4


def run(coro):
    return asyncio.run(coro)


def test_session_created_describes_both_sides(echo_server):
    res = run(converse(echo_server.ws(), [], end=True))
    c = res.created
    assert c["type"] == "session.created" and c["protocol"] == "duplex/1"
    assert c["engine"] == "synthetic" and c["frame_ms"] == 80 and c["session_id"]
    assert c["input"] == {"format": "pcm_f32le", "sample_rate": 24000, "frame_samples": 1920}
    assert c["output"] == c["input"]
    assert res.closed == {"type": "session.closed", "reason": "completed",
                          "frames_in": 0, "frames_out": 0, "frames_dropped": 0,
                          "turnaround_ms": {"p50": 0.0, "p99": 0.0, "max": 0.0}, "late_frames": 0}
    assert set(c["resume"]) == {"token", "grace_s"} and c["resume"]["grace_s"] == 30
    assert res.close_code == 1000


def test_f32_echo_returns_the_sent_bytes_exactly(echo_server):
    audio = signal(25).tobytes()
    chunks = [audio[i : i + FRAME_BYTES] for i in range(0, len(audio), FRAME_BYTES)]
    res = run(converse(echo_server.ws(), chunks))
    assert len(res.frames) == 25
    assert all(len(f) == FRAME_BYTES for f in res.frames)
    assert b"".join(res.frames) == audio
    assert res.closed["frames_in"] == 25 and res.closed["frames_out"] == 25
    assert res.closed["frames_dropped"] == 0 and res.close_code == 1000


@pytest.mark.parametrize("frames_per_message", [2.0, 0.5, 1.25])
def test_messages_of_any_length_are_cut_into_frames(echo_server, frames_per_message):
    audio = signal(10, seed=3).tobytes()
    step = int(FRAME_BYTES * frames_per_message)
    res = run(converse(echo_server.ws(), [audio[i : i + step] for i in range(0, len(audio), step)]))
    assert b"".join(res.frames) == audio
    assert len(res.frames) == 10


def test_input_end_pads_the_partial_frame_with_silence(echo_server):
    audio = signal(2, seed=4)
    sent = audio[: 1920 + 700]
    res = run(converse(echo_server.ws(), [sent.tobytes()]))
    assert len(res.frames) == 2
    back = np.frombuffer(b"".join(res.frames), np.float32)
    assert np.array_equal(back[: len(sent)], sent)
    assert not back[len(sent) :].any()
    assert res.closed["reason"] == "completed" and res.close_code == 1000


def test_text_deltas_are_aligned_with_output_frames(echo_server):
    res = run(converse(echo_server.ws(), [signal(12, seed=5).tobytes()]))
    deltas = res.of_type("text.delta")
    assert [d["frame"] for d in deltas] == [0, 5, 10]
    assert all(isinstance(d["text"], str) and d["text"] for d in deltas)


def test_text_delta_is_what_json_dumps_writes():
    import json

    from duplexserve.server.protocols.native import text_delta

    for text in ("", " hello", 'quote " back\\slash', "é ünï \u2028 \x00 \U0001f600", "\n\t"):
        for frame in (0, 7, np.int64(123456)):
            event = {"type": "text.delta", "frame": int(frame), "text": text}
            assert text_delta(frame, text) == json.dumps(event)


def test_s16_round_trip_within_one_step(echo_server):
    pcm = (signal(6, seed=6) * 32767).astype("<i2")
    url = echo_server.ws(query="input_format=pcm_s16le&output_format=pcm_s16le")
    res = run(converse(url, [pcm.tobytes()]))
    assert res.created["input"]["format"] == "pcm_s16le"
    back = np.frombuffer(b"".join(res.frames), "<i2")
    assert len(back) == len(pcm)
    assert np.max(np.abs(back.astype(int) - pcm.astype(int))) <= 1


def test_session_update_before_audio_changes_formats(echo_server):
    update = {"type": "session.update", "output": {"format": "pcm_s16le"}}
    audio = signal(3, seed=7)
    res = run(converse(echo_server.ws(), [update, audio.tobytes()]))
    updated = res.of_type("session.updated")
    assert len(updated) == 1 and updated[0]["output"]["format"] == "pcm_s16le"
    assert updated[0]["input"]["format"] == "pcm_f32le"
    assert all(len(f) == 1920 * 2 for f in res.frames) and len(res.frames) == 3


def test_ping_is_answered_with_the_same_id(echo_server):
    res = run(converse(echo_server.ws(), [{"type": "ping", "id": "abc-1"}, {"type": "ping", "id": 7}]))
    assert [p["id"] for p in res.of_type("pong")] == ["abc-1", 7]


def test_session_close_reports_counts(echo_server):
    res = run(converse(echo_server.ws(), [signal(4).tobytes(), {"type": "session.close"}], end=False))
    closed = res.closed
    assert closed["reason"] == "client_closed" and res.close_code == 1000
    assert closed["frames_in"] == 4
    assert closed["frames_out"] + closed["frames_dropped"] == 4


def test_32_concurrent_sessions_each_get_all_frames_in_order(echo_server):
    async def many():
        audios = [signal(40, seed=100 + i).tobytes() for i in range(32)]
        chunk = 2 * FRAME_BYTES
        results = await asyncio.gather(*(
            converse(echo_server.ws(), [a[j : j + chunk] for j in range(0, len(a), chunk)])
            for a in audios
        ))
        return audios, results

    audios, results = run(many())
    for audio, res in zip(audios, results, strict=True):
        assert b"".join(res.frames) == audio
        assert res.closed["frames_dropped"] == 0


def test_native_pcm_makes_no_executor_submissions(echo_server):
    before = echo_server.metrics()
    run(converse(echo_server.ws(), [signal(30, seed=9).tobytes()]))
    after = echo_server.metrics()
    assert after["duplexserve_frames_out_total"] - before["duplexserve_frames_out_total"] == 30
    assert after["duplexserve_executor_submissions_total"] == before["duplexserve_executor_submissions_total"]


def test_order_holds_when_the_engine_queue_is_full(server_factory):
    server = server_factory("--queue-size", "1", "--step-base-ms", "10", "--inflight-frames", "8")

    async def burst():
        audios = [signal(60, seed=200 + i).tobytes() for i in range(16)]
        results = await asyncio.gather(*(
            converse(server.ws(), [a[j : j + FRAME_BYTES] for j in range(0, len(a), FRAME_BYTES)])
            for a in audios
        ))
        return audios, results

    audios, results = run(burst())
    for audio, res in zip(audios, results, strict=True):
        assert b"".join(res.frames) == audio
    m = server.metrics()
    assert m["duplexserve_queue_full_waits_total"] > 0, "the queue was never full"
    assert m["duplexserve_executor_submissions_total"] <= m["duplexserve_queue_slow_puts_total"]


def test_delay_frames_answers_with_silence_first_and_input_end_finishes_the_answer(server_factory):
    """A model answering 3 frames late is stepped on 3 frames of silence after input.end
    (docs/protocol.md): the echo of the last input frame is heard, as tail frames 6 to 8."""
    server = server_factory("--delay-frames", "3")
    audio = signal(6, seed=11)
    res = run(converse(server.ws(), [audio.tobytes()]))
    back = np.frombuffer(b"".join(res.frames), np.float32).reshape(9, 1920)
    assert not back[:3].any()
    assert np.array_equal(back[3:], audio.reshape(6, 1920))
    closed = res.closed
    assert closed["reason"] == "completed" and closed["frames_in"] == 6
    assert (closed["frames_out"], closed["frames_tail"], closed["frames_dropped"]) == (9, 3, 0)


# ----------------------------------------------------------------------------- bad input
async def _expect_close(url: str, *messages: bytes | str) -> tuple[list[dict], int | None]:
    async with websockets.asyncio.client.connect(url, compression=None, max_size=None) as ws:
        await ws.recv()
        events = []
        for m in messages:
            await ws.send(m)
        with contextlib.suppress(websockets.ConnectionClosed):
            async for msg in ws:
                if isinstance(msg, str):
                    events.append(json.loads(msg))
        return events, ws.close_code


async def _healthy(url: str) -> bool:
    audio = signal(3, seed=99).tobytes()
    res = await converse(url, [audio])
    return b"".join(res.frames) == audio


@pytest.mark.parametrize(
    ("messages", "code", "close"),
    [
        ((b"\x00" * 7,), "invalid_audio", 1003),
        (("{not json",), "invalid_json", 1007),
        (('["a list"]',), "invalid_event", 1007),
        (("[" * 200_000,), "invalid_json", 1007),
        ((b"\x00" * ((1 << 20) + 4),), "message_too_big", 1009),
    ],
    ids=["odd-bytes", "invalid-json", "not-an-object", "deeply-nested", "oversized"],
)
def test_bad_input_gets_an_error_and_its_close_code(echo_server, messages, code, close):
    async def scenario():
        bystander = asyncio.create_task(
            converse(echo_server.ws(), [signal(20, seed=1).tobytes()[i:i + FRAME_BYTES]
                                        for i in range(0, 20 * FRAME_BYTES, FRAME_BYTES)], gap=0.01)
        )
        events, close_code = await _expect_close(echo_server.ws(), *messages)
        res = await bystander
        return events, close_code, res, await _healthy(echo_server.ws())

    events, close_code, bystander, healthy = run(scenario())
    errors_ = [e for e in events if e["type"] == "error"]
    assert errors_ and errors_[0]["code"] == code and errors_[0]["fatal"] is True
    assert close_code == close
    assert events[-1]["type"] == "session.closed" and events[-1]["reason"] == code
    assert len(bystander.frames) == 20 and bystander.closed["reason"] == "completed"
    assert healthy


def test_session_update_after_audio_is_locked_but_not_fatal(echo_server):
    audio = signal(2, seed=12).tobytes()
    update = {"type": "session.update", "output": {"format": "pcm_s16le"}}
    res = run(converse(echo_server.ws(), [audio, update]))
    errs = res.of_type("error")
    assert errs and errs[0]["code"] == "session_locked" and errs[0]["fatal"] is False
    assert b"".join(res.frames) == audio and res.close_code == 1000


def test_unknown_event_is_an_error_and_the_session_goes_on(echo_server):
    audio = signal(2, seed=13).tobytes()
    res = run(converse(echo_server.ws(), [{"type": "no.such.event"}, audio]))
    assert res.of_type("error")[0]["code"] == "unknown_event"
    assert b"".join(res.frames) == audio


def test_unsupported_format_in_query_is_refused_before_audio(echo_server):
    async def scenario():
        async with websockets.asyncio.client.connect(echo_server.ws(query="input_format=mp3")) as ws:
            first = json.loads(await ws.recv())
            with contextlib.suppress(websockets.ConnectionClosed):
                await ws.recv()
            return first, ws.close_code

    first, code = run(scenario())
    assert first["type"] == "error" and first["code"] == "unsupported_format" and first["fatal"]
    assert code == 1003


def test_over_max_sessions_gets_1013_and_ready_says_503(server_factory):
    import httpx

    server = server_factory("--max-sessions", "2")

    async def scenario():
        a = await websockets.asyncio.client.connect(server.ws(), compression=None)
        b = await websockets.asyncio.client.connect(server.ws(), compression=None)
        await a.recv(), await b.recv()
        ready = httpx.get(server.http + "/ready").status_code
        async with websockets.asyncio.client.connect(server.ws(), compression=None) as c:
            err = json.loads(await c.recv())
            with pytest.raises(websockets.ConnectionClosed):
                await c.recv()
            code = c.close_code
        await a.send(signal(2).tobytes())
        await a.send(json.dumps({"type": "input.end"}))
        frames = [m async for m in a if isinstance(m, bytes)]
        await b.close()
        return ready, err, code, len(frames)

    ready, err, code, frames = run(scenario())
    assert ready == 503
    assert err["type"] == "error" and err["code"] == "server_unavailable"
    assert code == 1013
    assert frames == 2
    assert server.metrics()["duplexserve_sessions_rejected_total"] == 1
