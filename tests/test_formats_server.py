"""Every wire format end to end over a real socket, against the echo engine.

The client replays the server's side with the same codecs (decoder, echo, encoder; they
are deterministic, Opus included), so each answer must match byte for byte; and it
decodes the answer and compares it with what it sent, so the audio is also right.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import urllib.parse

import numpy as np
import pytest
import soxr
import websockets.asyncio.client

from duplexserve.codecs import FRAME_SAMPLES, MODEL_RATE, AudioFormat, make_decoder, make_encoder
from duplexserve.codecs.libopus import DEFAULT_COMPLEXITY, LIBOPUS
from duplexserve.codecs.procpool import CodecProcesses
from duplexserve.codecs.resample import frame_samples_total
from tests.native_client import Result, converse

SECONDS = 1.2


def speechlike(rate: int, seed: int, seconds: float = SECONDS) -> np.ndarray:
    """A few wobbling tones in the speech band, different for every seed."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    x = 0.0
    for _ in range(3):
        wobble = 2 * np.sin(2 * np.pi * rng.uniform(0.5, 3) * t)
        x = x + 0.15 * np.sin(2 * np.pi * rng.uniform(200, 3000) * t + wobble)
    return x.astype(np.float32)


def wire_messages(x: np.ndarray, fmt: AudioFormat, message_ms: int) -> list[bytes]:
    """The client's audio in ``fmt``: Opus as one message per Ogg page pair (40 ms), as
    Kyutai's clients send it; everything else cut into ``message_ms`` messages."""
    if fmt.format == "opus":
        enc = make_encoder(fmt)
        pad = -len(x) % FRAME_SAMPLES
        x = np.concatenate((x, np.zeros(pad, np.float32)))
        return [enc.encode(f) for f in x.reshape(-1, FRAME_SAMPLES)]
    wire = make_encoder(AudioFormat(fmt.format, MODEL_RATE)).encode(x)  # the sample format only
    step = fmt.sample_rate * message_ms // 1000 * len(wire) // len(x)
    return [wire[i : i + step] for i in range(0, len(wire), step)]


def expected_answer(messages: list[bytes], inp: AudioFormat, out: AudioFormat,
                    opus_complexity: int = DEFAULT_COMPLEXITY) -> list[bytes]:
    """What the server must send back: its decoder, the echo, then its encoder, replayed."""
    dec, enc = make_decoder(inp), make_encoder(out, CodecProcesses(0, opus_complexity))
    model = np.concatenate([dec.decode(m) for m in messages] + [dec.flush()])
    model = np.concatenate((model, np.zeros(-len(model) % FRAME_SAMPLES, np.float32)))
    return [enc.encode(f) for f in model.reshape(-1, FRAME_SAMPLES)]


def decode_all(frames: list[bytes], fmt: AudioFormat) -> np.ndarray:
    """The answer as float32 at the output rate."""
    if fmt.format == "opus":
        dec = make_decoder(fmt)
        return np.concatenate([dec.decode(f) for f in frames])
    to24 = make_decoder(AudioFormat(fmt.format, MODEL_RATE))  # the sample format only
    return to24.decode(b"".join(frames))


def best_correlation(ref: np.ndarray, out: np.ndarray, max_lag: int) -> float:
    n = len(ref) + len(out)
    corr = np.fft.irfft(np.fft.rfft(out, n) * np.conj(np.fft.rfft(ref, n)), n)
    lag = int(np.argmax(corr[: max_lag + 1]))
    m = min(len(ref), len(out) - lag)
    return float(np.corrcoef(ref[:m], out[lag : lag + m])[0, 1])


def query(inp: AudioFormat, out: AudioFormat) -> str:
    return urllib.parse.urlencode({
        "input_format": inp.format, "input_sample_rate": inp.sample_rate,
        "output_format": out.format, "output_sample_rate": out.sample_rate,
    })


async def stream(server, inp: AudioFormat, out: AudioFormat, seed: int, message_ms: int = 20,
                 opus_complexity: int = DEFAULT_COMPLEXITY) -> Result:
    """One session streaming ``SECONDS`` of audio; checks everything about its answer."""
    x = speechlike(inp.sample_rate, seed)
    messages = wire_messages(x, inp, message_ms)
    res = await converse(server.ws(query=query(inp, out)), messages)
    assert res.created["input"] == inp.describe() and res.created["output"] == out.describe()
    assert res.closed is not None and res.closed["reason"] == "completed", res.events
    assert res.closed["frames_dropped"] == 0 and not res.of_type("error")
    expected = expected_answer(messages, inp, out, opus_complexity)
    assert len(res.frames) == len(expected) == res.closed["frames_out"]
    assert res.frames == expected  # byte for byte what the server's own codecs give
    if out.format == "opus":
        assert b"OpusHead" in res.frames[0] and b"OpusTags" in res.frames[0]
        if LIBOPUS is not None:  # the libopus writer (libopus.py) names itself in OpusTags, sphn's does not
            assert b"duplexserve" in res.frames[0] and b"KyutaiMoshi" not in res.frames[0]
    else:
        width = {"pcm_f32le": 4, "pcm_s16le": 2}.get(out.format, 1)
        sizes = [len(f) // width for f in res.frames]
        assert sum(sizes) == frame_samples_total(len(sizes), out.sample_rate) and max(sizes) - min(sizes) <= 1
    # And the audio is the audio sent: compare at the output rate.
    sent = decode_all(messages, inp) if inp.format == "opus" else x
    if inp.sample_rate != out.sample_rate:
        sent = soxr.resample(sent, inp.sample_rate, out.sample_rate).astype(np.float32)
    assert best_correlation(sent, decode_all(res.frames, out), out.sample_rate // 5) > 0.9
    return res


FORMATS = [
    pytest.param(AudioFormat("pcm_s16le", 24000), AudioFormat("pcm_s16le", 24000), id="s16-24k"),
    pytest.param(AudioFormat("pcm_s16le", 16000), AudioFormat("pcm_s16le", 16000), id="s16-16k"),
    pytest.param(AudioFormat("pcm_f32le", 48000), AudioFormat("pcm_f32le", 48000), id="browser-f32-48k"),
    pytest.param(AudioFormat("g711_ulaw", 8000), AudioFormat("g711_ulaw", 8000), id="telephony-ulaw-8k"),
    pytest.param(AudioFormat("g711_alaw", 8000), AudioFormat("pcm_s16le", 16000), id="alaw-8k-to-s16-16k"),
    pytest.param(AudioFormat("opus"), AudioFormat("opus"), id="opus"),
    pytest.param(AudioFormat("pcm_s16le", 44100), AudioFormat("opus"), id="s16-44k1-to-opus"),
    pytest.param(AudioFormat("pcm_f32le", 192000), AudioFormat("g711_alaw", 24000), id="f32-192k-threads"),
]


@pytest.mark.parametrize(("inp", "out"), FORMATS)
def test_format_end_to_end(echo_server, inp, out):
    asyncio.run(stream(echo_server, inp, out, seed=7))


# ----------------------------------------------------------------- negotiation
def test_session_update_switches_to_opus_and_g711_before_audio(echo_server):
    x = speechlike(MODEL_RATE, seed=3)
    inp, out = AudioFormat("opus"), AudioFormat("g711_alaw", 8000)
    messages = wire_messages(x, inp, 40)
    update = {"type": "session.update", "input": {"format": "opus"},
              "output": {"format": "g711_alaw", "sample_rate": 8000}}
    res = asyncio.run(converse(echo_server.ws(), [update, *messages]))
    updated = res.of_type("session.updated")
    assert len(updated) == 1
    assert updated[0]["input"] == inp.describe() and updated[0]["output"] == out.describe()
    assert res.frames == expected_answer(messages, inp, out) and res.closed["reason"] == "completed"


def test_unsupported_session_update_is_an_error_and_formats_stay(echo_server):
    update = {"type": "session.update", "input": {"format": "opus", "sample_rate": 16000}}
    audio = speechlike(MODEL_RATE, seed=4, seconds=0.16)
    res = asyncio.run(converse(echo_server.ws(), [update, audio.tobytes()]))
    errors = res.of_type("error")
    assert [e["code"] for e in errors] == ["unsupported_format"] and not errors[0]["fatal"]
    assert "24000" in errors[0]["message"] and not res.of_type("session.updated")
    assert b"".join(res.frames) == audio.tobytes()  # still native PCM, untouched


@pytest.mark.parametrize("q", [
    "input_format=opus&input_sample_rate=48000",
    "output_format=opus&output_sample_rate=16000",
    "input_format=g711_ulaw&input_sample_rate=4000",
    "output_format=pcm_s16le&output_sample_rate=384000",
    "input_format=mp3",
    "output_format=pcm_s24le",
])
def test_unsupported_combination_is_refused_before_any_audio(echo_server, q):
    async def scenario():
        messages = []
        async with websockets.asyncio.client.connect(echo_server.ws(query=q), compression=None) as ws:
            with contextlib.suppress(websockets.ConnectionClosed):
                while True:
                    messages.append(await ws.recv())
            return messages, ws.close_code

    messages, code = asyncio.run(scenario())
    assert code == 1003 and len(messages) == 1 and isinstance(messages[0], str)
    first = json.loads(messages[0])
    assert first["type"] == "error" and first["code"] == "unsupported_format" and first["fatal"]
    assert first["message"]  # says what is wrong


# ------------------------------------------------------- sessions at once, pools
def test_concurrent_transcoding_sessions_never_mix_state(server_factory):
    """Six sessions at once, both sessions of each format in one codec process."""
    server = server_factory("--codec-processes", "1")
    specs = [(AudioFormat("opus"), AudioFormat("opus")),
             (AudioFormat("g711_ulaw", 8000), AudioFormat("g711_ulaw", 8000)),
             (AudioFormat("pcm_f32le", 192000), AudioFormat("pcm_s16le", 48000))]

    async def scenario():
        runs = [stream(server, inp, out, seed=100 + i, message_ms=40)
                for i, (inp, out) in enumerate(specs * 2)]
        return await asyncio.gather(*runs)

    results = asyncio.run(scenario())  # stream() checks each answer against its own input
    assert results[0].frames != results[3].frames  # different inputs, different answers


def metric(server, name: str) -> float:
    return server.metrics()[f"duplexserve_{name}_total"]


def test_executor_submissions_zero_for_native_counted_for_transcoding(server_factory):
    server = server_factory()

    def run_session(inp: AudioFormat, out: AudioFormat) -> tuple[float, Result, int]:
        before = metric(server, "executor_submissions")
        x = speechlike(inp.sample_rate, seed=21)
        messages = wire_messages(x, inp, 40)
        res = asyncio.run(converse(server.ws(query=query(inp, out)), messages))
        assert res.closed["reason"] == "completed"
        return metric(server, "executor_submissions") - before, res, len(messages)

    for inline in [(AudioFormat(), AudioFormat()), (AudioFormat("pcm_s16le"), AudioFormat("pcm_s16le")),
                   (AudioFormat("g711_ulaw", 8000), AudioFormat("pcm_f32le", 48000))]:
        hops, res, _ = run_session(*inline)
        assert hops == 0 and len(res.frames) == 15
    assert metric(server, "codec_processes_cpu_seconds") == 0  # no Opus yet: no worker started
    # Opus in a codec process, 192 kHz on the thread pool: one hop per message in, per frame out.
    for offloaded in [(AudioFormat("opus"), AudioFormat("opus")),
                      (AudioFormat("pcm_s16le", 192000), AudioFormat("pcm_f32le", 192000))]:
        hops, res, n_messages = run_session(*offloaded)
        assert hops == n_messages + len(res.frames)
    assert metric(server, "codec_processes_cpu_seconds") > 0  # the workers' CPU is reported


def test_opus_inline_without_codec_processes(server_factory):
    server = server_factory("--codec-processes", "0")
    before = metric(server, "executor_submissions")
    asyncio.run(stream(server, AudioFormat("opus"), AudioFormat("opus"), seed=5))
    assert metric(server, "executor_submissions") == before  # sphn runs on the loop, no hop


@pytest.mark.parametrize("processes", ["0", "1"])
def test_opus_complexity_setting_reaches_the_encoder(server_factory, processes):
    server = server_factory("--opus-complexity", "0", "--codec-processes", processes)
    inp, out = AudioFormat("pcm_s16le", 24000), AudioFormat("opus")
    asyncio.run(stream(server, inp, out, seed=9, opus_complexity=0))


def test_a_dead_codec_worker_ends_its_sessions_and_the_server_goes_on(server_factory):
    server = server_factory("--codec-processes", "1")
    inp = out = AudioFormat("opus")
    messages = wire_messages(speechlike(MODEL_RATE, seed=9, seconds=2.0), inp, 80)

    async def scenario():
        url = server.ws(query=query(inp, out))
        async with websockets.asyncio.client.connect(url, compression=None) as ws:
            await ws.recv()
            for m in messages[:4]:
                await ws.send(m)
            answers = 0
            while answers < 4:  # the worker is up and serving this session
                answers += isinstance(await asyncio.wait_for(ws.recv(), 10), bytes)
            with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
                workers = [int(pid) for pid in f.read().split()]
            assert len(workers) == 1
            os.kill(workers[0], signal.SIGKILL)
            events = []
            with contextlib.suppress(websockets.ConnectionClosed):
                for m in messages[4:]:
                    await ws.send(m)
                while True:
                    msg = await asyncio.wait_for(ws.recv(), 10)
                    if isinstance(msg, str):
                        events.append(json.loads(msg))
            return events, ws.close_code

    events, code = asyncio.run(scenario())
    closed = [e for e in events if e.get("type") == "session.closed"]
    assert code == 1011 and closed and closed[0]["reason"] == "internal_error"
    asyncio.run(stream(server, inp, out, seed=10))  # a new worker serves the next session


def test_opus_input_that_is_not_ogg_is_refused_with_1003(echo_server):
    pcm = speechlike(MODEL_RATE, seed=6, seconds=0.08).tobytes()
    res = asyncio.run(converse(echo_server.ws(query="input_format=opus&output_format=opus"), [pcm]))
    errors = res.of_type("error")
    assert errors and errors[0]["code"] == "invalid_audio" and "Ogg" in errors[0]["message"]
    assert res.close_code == 1003 and not res.frames
