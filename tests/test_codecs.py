"""Codec round trips, known G.711 codes, streaming resampling and Ogg/Opus, in process."""

from __future__ import annotations

import asyncio
import gc
import shutil
import subprocess
import warnings
import wave

import numpy as np
import pytest
import soxr

from duplexserve.codecs import (
    FRAME_SAMPLES,
    MODEL_RATE,
    AudioFormat,
    FormatError,
    g711,
    make_decoder,
    make_encoder,
    pcm,
)
from duplexserve.codecs.procpool import COST, OP_OPEN_ENCODER, CodecProcessError, CodecProcesses
from duplexserve.codecs.resample import FrameResampler, frame_samples_total

RNG = np.random.default_rng(1234)


def sweep(rate: int, seconds: float, f0: float, f1: float, amp: float = 0.5) -> np.ndarray:
    """A logarithmic sine sweep from ``f0`` to ``f1`` Hz."""
    t = np.arange(int(rate * seconds)) / rate
    k = np.log(f1 / f0) / seconds
    return (amp * np.sin(2 * np.pi * f0 * (np.exp(k * t) - 1) / k)).astype(np.float32)


def align(ref: np.ndarray, out: np.ndarray, max_lag: int) -> int:
    """The lag of ``out`` behind ``ref`` that maximises their cross-correlation."""
    n = len(ref) + len(out)
    corr = np.fft.irfft(np.fft.rfft(out, n) * np.conj(np.fft.rfft(ref, n)), n)
    return int(np.argmax(corr[: max_lag + 1]))


def snr_db(ref: np.ndarray, out: np.ndarray, lag: int, margin: int) -> float:
    """SNR of ``out`` (lagged) against ``ref``, leaving out ``margin`` samples at each end."""
    n = min(len(ref), len(out) - lag) - margin
    a, b = ref[margin:n], out[lag + margin : lag + n]
    return float(10 * np.log10(np.sum(a.astype(np.float64) ** 2) / np.sum((a - b).astype(np.float64) ** 2)))


def frames_of(samples: np.ndarray) -> list[np.ndarray]:
    whole = len(samples) // FRAME_SAMPLES * FRAME_SAMPLES
    return list(samples[:whole].reshape(-1, FRAME_SAMPLES))


def chunks(data: bytes, sizes: list[int]) -> list[bytes]:
    out, pos, i = [], 0, 0
    while pos < len(data):
        out.append(data[pos : pos + sizes[i % len(sizes)]])
        pos += sizes[i % len(sizes)]
        i += 1
    return out


@pytest.fixture(scope="module")
def speech16k(tmp_path_factory) -> np.ndarray:
    """Real speech from espeak-ng (installed by .ci/run), at 16 kHz."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (.ci/run installs it)")
    path = tmp_path_factory.mktemp("speech") / "speech.wav"
    text = "Full duplex speech models listen and talk at the same time, eighty milliseconds a frame."
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True)
    with wave.open(str(path)) as w:
        rate = w.getframerate()
        raw = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
    speech = soxr.resample(raw, rate, 16000, quality="VHQ").astype(np.float32)
    assert len(speech) > 16000 and np.abs(speech).max() > 0.1
    return speech


# --------------------------------------------------------------------------- PCM
def test_s16_round_trip_within_one_lsb():
    edges = [-1.0, 0.0, 1 / 65536, 32767 / 32768]
    x = np.concatenate([RNG.uniform(-1, 1, 100_000), edges]).astype(np.float32)
    enc, dec = make_encoder(AudioFormat("pcm_s16le")), make_decoder(AudioFormat("pcm_s16le"))
    assert enc.inline and dec.inline
    y = dec.decode(enc.encode(x))
    assert np.max(np.abs(y - x)) <= 1 / 32768
    grid = np.arange(-32768, 32768, dtype="<i2").tobytes()  # every int16 value survives exactly
    assert enc.encode(dec.decode(grid)) == grid


def test_s16_clips_out_of_range():
    assert np.frombuffer(pcm.f32_to_s16(np.array([1.5, -1.5, 1.0], np.float32)), "<i2").tolist() == [
        32767, -32768, 32767,
    ]


def test_native_f32_is_a_view_and_odd_bytes_are_refused():
    data = (np.arange(FRAME_SAMPLES, dtype="<f4") / FRAME_SAMPLES).tobytes()  # audio: within [-1, 1]
    decoded = make_decoder(AudioFormat()).decode(data)
    assert decoded.base is not None and decoded.tobytes() == data
    with pytest.raises(FormatError):
        make_decoder(AudioFormat()).decode(b"\x00" * 6)
    with pytest.raises(FormatError):
        make_decoder(AudioFormat("pcm_s16le", 16000)).decode(b"\x00" * 3)


# ------------------------------------------------------------------------- G.711
# Known code values from ITU-T G.711 (as in Sun's reference g711.c): code -> 16-bit PCM.
ULAW_CODES = {0x00: -32124, 0x7F: 0, 0x80: 32124, 0xFF: 0, 0xF0: 120, 0x70: -120, 0xEF: 132, 0xA0: 7932}
ALAW_CODES = {0xD5: 8, 0x55: -8, 0xAA: 32256, 0x2A: -32256, 0xD4: 24, 0x80: 5504, 0xC5: 264}
# 16-bit PCM -> code, including both ends and the clip.
ULAW_ENCODE = {0: 0xFF, -1: 0x7E, 32767: 0x80, -32768: 0x00, 120: 0xF0, 7932: 0xA0}
ALAW_ENCODE = {0: 0xD5, -1: 0x55, 32767: 0xAA, -32768: 0x2A, 24: 0xD4, 264: 0xC5}


@pytest.mark.parametrize(
    ("name", "decode_table", "codes", "encode_table", "encodes"),
    [
        ("ulaw", g711.ULAW_TO_S16, ULAW_CODES, g711.S16_TO_ULAW, ULAW_ENCODE),
        ("alaw", g711.ALAW_TO_S16, ALAW_CODES, g711.S16_TO_ALAW, ALAW_ENCODE),
    ],
)
def test_g711_known_code_values(name, decode_table, codes, encode_table, encodes):
    for code, value in codes.items():
        assert decode_table[code] == value, f"{name} code {code:#04x}"
    for value, code in encodes.items():
        assert encode_table[np.uint16(np.int16(value))] == code, f"{name} of {value}"
    # Every decoded level encodes back to a code of the same level.
    assert np.array_equal(decode_table[encode_table[decode_table.view(np.uint16)]], decode_table)


@pytest.mark.parametrize("law", ["ulaw", "alaw"])
def test_g711_matches_the_reference_implementation_bit_for_bit(law):
    audioop = pytest.importorskip("audioop")  # CPython <= 3.12 ships Sun's g711 code
    everything = np.arange(-32768, 32768, dtype="<i2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ref_codes = getattr(audioop, f"lin2{law}")(everything.tobytes(), 2)
        ref_levels = getattr(audioop, f"{law}2lin")(bytes(range(256)), 2)
    table = g711.S16_TO_ULAW if law == "ulaw" else g711.S16_TO_ALAW
    levels = g711.ULAW_TO_S16 if law == "ulaw" else g711.ALAW_TO_S16
    assert table[everything.view(np.uint16)].tobytes() == ref_codes
    assert levels.astype("<i2").tobytes() == ref_levels


@pytest.mark.parametrize("fmt", ["g711_ulaw", "g711_alaw"])
def test_g711_through_the_codec_objects(fmt):
    x = sweep(MODEL_RATE, 0.4, 100, 3000)
    enc, dec = make_encoder(AudioFormat(fmt)), make_decoder(AudioFormat(fmt))
    assert enc.inline and dec.inline
    wire = b"".join(enc.encode(f) for f in frames_of(x))
    assert len(wire) == len(x)  # one byte a sample
    y = dec.decode(wire)
    assert snr_db(x, y, 0, 0) > 30  # G.711 is about 38 dB on a loud signal


# -------------------------------------------------------------------- resampling
def resample_round_trip(signal16k: np.ndarray, message: int = 320) -> tuple[np.ndarray, list[int]]:
    """16 kHz client audio in ``message``-sample messages, to 24 kHz and back in frames."""
    fmt = AudioFormat("pcm_f32le", 16000)
    dec, enc = make_decoder(fmt), make_encoder(fmt)
    model = [dec.decode(m) for m in chunks(signal16k.tobytes(), [4 * message])]
    model.append(dec.flush())
    out = [np.frombuffer(enc.encode(f), "<f4") for f in frames_of(np.concatenate(model))]
    return np.concatenate(out), [len(o) for o in out]


def test_resample_16k_sweep_round_trip_over_40_db():
    x = sweep(16000, 3.0, 50, 7000)
    y, sizes = resample_round_trip(x)
    assert set(sizes) == {1280}  # every output message is one 80 ms frame at 16 kHz
    lag = align(x, y, 4000)
    assert snr_db(x, y, lag, 1600) > 40


def lowpass(x: np.ndarray, rate: int, cutoff: float) -> np.ndarray:
    spectrum = np.fft.rfft(x)
    spectrum[np.fft.rfftfreq(len(x), 1 / rate) > cutoff] = 0
    return np.fft.irfft(spectrum, len(x)).astype(np.float32)


def test_resample_16k_speech_round_trip_over_40_db(speech16k):
    # Wideband speech is 50-7000 Hz (ITU-T G.722); in that band the round trip is exact to
    # about 130 dB. Above it, soxr HQ's passband ends at 91% of 8 kHz, so the last 0.7 kHz
    # of a full-band 16 kHz source is attenuated: espeak's sibilants put -31 dB of their
    # energy there, which costs the full-band figure down to about 40 dB.
    wideband = lowpass(speech16k, 16000, 7000)
    y, _ = resample_round_trip(wideband, message=160)
    assert snr_db(wideband, y, align(wideband, y, 4000), 1600) > 40
    y, _ = resample_round_trip(speech16k, message=160)
    assert snr_db(speech16k, y, align(speech16k, y, 4000), 1600) > 35


def test_resampling_does_not_depend_on_message_boundaries():
    """Streaming state carries across messages: any cut gives the same samples (no clicks)."""
    x = sweep(48000, 1.0, 100, 15000).tobytes()
    whole = make_decoder(AudioFormat("pcm_f32le", 48000))
    ref = np.concatenate([whole.decode(x), whole.flush()])
    cut = make_decoder(AudioFormat("pcm_f32le", 48000))
    got = np.concatenate([cut.decode(m) for m in chunks(x, [4, 3844, 1920 * 4, 40])] + [cut.flush()])
    assert len(got) == len(ref) == 24000
    assert np.max(np.abs(got - ref)) < 1e-6


@pytest.mark.parametrize("rate", [8000, 8001, 11025, 44100, 48000, 192000])
def test_output_messages_are_whole_80ms_frames_without_drift(rate):
    rs = FrameResampler(rate)
    sizes = [len(rs.process(f)) for f in frames_of(sweep(MODEL_RATE, 4.0, 100, 3000))]
    assert sum(sizes) == frame_samples_total(len(sizes), rate)
    assert max(sizes) - min(sizes) <= 1 and rs.underruns == 0


def test_g711_8k_composes_with_resampling():
    fmt = AudioFormat("g711_ulaw", 8000)
    dec, enc = make_decoder(fmt), make_encoder(fmt)
    assert dec.inline and enc.inline
    x = sweep(8000, 2.0, 100, 3400)
    wire = g711.f32_to_ulaw(x)
    model = np.concatenate([dec.decode(m) for m in chunks(wire, [160])] + [dec.flush()])
    assert abs(len(model) - 3 * len(x)) <= 3
    out = b"".join(enc.encode(f) for f in frames_of(model))
    assert len(out) == len(model) // FRAME_SAMPLES * 640
    y = g711.ulaw_to_f32(out)
    assert snr_db(x, y, align(x, y, 2000), 800) > 25  # two G.711 passes and two resamplings


def test_high_rates_leave_the_loop_low_rates_stay():
    assert make_decoder(AudioFormat("pcm_s16le", 48000)).inline
    assert make_encoder(AudioFormat("g711_alaw", 96000)).inline
    assert not make_decoder(AudioFormat("pcm_f32le", 192000)).inline
    assert not make_encoder(AudioFormat("pcm_s16le", 176400)).inline


# -------------------------------------------------------------------------- Opus
def opus_round_trip(x: np.ndarray, pieces: list[int]) -> tuple[np.ndarray, list[bytes]]:
    enc, dec = make_encoder(AudioFormat("opus")), make_decoder(AudioFormat("opus"))
    pages = [enc.encode(f) for f in frames_of(x)]
    y = np.concatenate([dec.decode(m) for m in chunks(b"".join(pages), pieces)] + [dec.flush()])
    return y, pages


def test_opus_stream_layout():
    _, pages = opus_round_trip(sweep(MODEL_RATE, 0.8, 200, 2000), [10**6])
    assert pages[0].startswith(b"OggS") and b"OpusHead" in pages[0] and b"OpusTags" in pages[0]
    assert pages[0].count(b"OggS") == 4  # OpusHead, OpusTags, then one page per 40 ms packet
    assert all(p.count(b"OggS") == 2 and b"OpusHead" not in p for p in pages[1:])


# Opus is a perceptual codec: it keeps the spectrum, not the waveform, so SNR says little.
# Correlation after aligning Opus's 6.5 ms look-ahead does: the encoder at sphn's
# default bitrate measured 0.95-0.97 on espeak speech and 0.90 on a sweep; 0.85 and 0.8
# fail on anything broken (silence, wrong alignment, a mixed-up stream scores near 0).
def test_opus_round_trip_on_speech(speech16k):
    x = soxr.resample(speech16k, 16000, MODEL_RATE).astype(np.float32)
    y, _ = opus_round_trip(x, [57, 4000, 300])
    lag = align(x, y, 2000)
    assert 100 <= lag <= 400
    n = len(y) - lag
    assert np.corrcoef(x[:n], y[lag : lag + n])[0, 1] > 0.85


def test_opus_round_trip_on_a_sweep():
    x = sweep(MODEL_RATE, 2.0, 100, 4000)
    y, _ = opus_round_trip(x, [7])
    assert len(y) == len(x)
    lag = align(x, y, 2000)
    assert np.corrcoef(x[: len(x) - lag], y[lag:])[0, 1] > 0.8


def test_opus_refuses_a_stream_that_is_not_ogg():
    dec = make_decoder(AudioFormat("opus"))
    with pytest.raises(FormatError, match="Ogg"):
        dec.decode(np.zeros(FRAME_SAMPLES, np.float32).tobytes())


def test_opus_rate_is_fixed():
    with pytest.raises(FormatError):
        AudioFormat.parse("opus", 48000)
    with pytest.raises(FormatError):
        make_decoder(AudioFormat("opus", 48000))


# ------------------------------------------------------------ two sessions at once
def tone(freq: float, seconds: float = 1.6) -> np.ndarray:
    t = np.arange(int(MODEL_RATE * seconds)) / MODEL_RATE
    return (0.4 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.mark.parametrize(
    "fmt", [AudioFormat("opus"), AudioFormat("pcm_s16le", 16000), AudioFormat("g711_alaw", 8000)]
)
def test_two_sessions_interleaved_never_mix_state(fmt):
    """Interleaving two sessions' calls gives each exactly what it gets alone."""
    signals = [tone(440), tone(1250)]

    def alone(x):
        enc = make_encoder(fmt)
        return [enc.encode(f) for f in frames_of(x)]

    expected = [alone(x) for x in signals]
    encs = [make_encoder(fmt), make_encoder(fmt)]
    got: list[list[bytes]] = [[], []]
    for fa, fb in zip(frames_of(signals[0]), frames_of(signals[1]), strict=True):
        got[0].append(encs[0].encode(fa))
        got[1].append(encs[1].encode(fb))
    assert got == expected and expected[0] != expected[1]

    decs = [make_decoder(fmt), make_decoder(fmt)]
    outs: list[list[np.ndarray]] = [[], []]
    for a, b in zip(expected[0], expected[1], strict=True):
        outs[0].append(decs[0].decode(a))
        outs[1].append(decs[1].decode(b))
    for i in range(2):
        ref = make_decoder(fmt)
        assert np.array_equal(np.concatenate(outs[i]), np.concatenate([ref.decode(m) for m in expected[i]]))


# ----------------------------------------------------------------- codec processes
def test_codec_process_matches_in_process_codecs_and_keeps_sessions_apart():
    signals = [tone(300), tone(2000)]
    local = []
    for x in signals:
        enc, dec = make_encoder(AudioFormat("opus")), make_decoder(AudioFormat("opus"))
        pages = [enc.encode(f) for f in frames_of(x)]
        local.append((pages, [dec.decode(p) for p in pages]))

    async def main():
        procs = CodecProcesses(1)  # both sessions in one worker: the harder case
        try:
            encs = [make_encoder(AudioFormat("opus"), procs) for _ in signals]
            decs = [make_decoder(AudioFormat("opus"), procs) for _ in signals]
            assert all(c.remote and not c.inline for c in encs + decs)

            async def session(i):
                pages, pcm_out = [], []
                for f in frames_of(signals[i]):
                    page = await encs[i].encode_async(f)
                    pages.append(page)
                    pcm_out.append(await decs[i].decode_async(page))
                return pages, pcm_out

            results = await asyncio.gather(session(0), session(1))
            bad = make_decoder(AudioFormat("opus"), procs)
            with pytest.raises(FormatError, match="Ogg"):
                await bad.decode_async(b"RIFF....")
            return results
        finally:
            procs.close()

    results = asyncio.run(main())
    for (pages, pcm_out), (ref_pages, ref_pcm) in zip(results, local, strict=True):
        assert pages == ref_pages
        assert all(np.array_equal(a, b) for a, b in zip(pcm_out, ref_pcm, strict=True))


def test_a_dead_codec_process_fails_its_sessions_not_the_caller():
    async def main():
        procs = CodecProcesses(1)
        try:
            dec = make_decoder(AudioFormat("opus"), procs)
            dec._worker.proc.kill()
            with pytest.raises(CodecProcessError):
                await dec.decode_async(b"OggS")
            fresh = make_encoder(AudioFormat("opus"), procs)  # a new worker replaces it
            assert (await fresh.encode_async(tone(500, 0.08))).startswith(b"OggS")
        finally:
            procs.close()

    asyncio.run(main())


def test_codecs_spread_over_workers_by_cost():
    async def main():
        procs = CodecProcesses(2)
        try:
            codecs = []
            for _ in range(10):  # ten sessions, each opening its decoder then its encoder
                codecs += [make_decoder(AudioFormat("opus"), procs), make_encoder(AudioFormat("opus"), procs)]
            loads = sorted(w.load for w in procs._workers)
            assert loads[1] - loads[0] <= COST[OP_OPEN_ENCODER]  # counting codecs: 10 against 80
            kinds = [{type(c).__name__ for c in codecs if c._worker is w} for w in procs._workers]
            assert all(k == {"RemoteOpusDecoder", "RemoteOpusEncoder"} for k in kinds)
        finally:
            procs.close()

    asyncio.run(main())


def test_a_dropped_remote_codec_is_freed_in_its_worker():
    async def main():
        procs = CodecProcesses(1)
        try:
            enc = make_encoder(AudioFormat("opus"), procs)
            worker = enc._worker
            assert (await enc.encode_async(tone(500, 0.08))).startswith(b"OggS")
            assert worker.load == COST[OP_OPEN_ENCODER]
            del enc
            gc.collect()
            await asyncio.sleep(0.05)  # the release runs on the loop
            assert worker.load == 0
        finally:
            procs.close()

    asyncio.run(main())
