"""The libopus (ctypes) Ogg/Opus reader: the same samples as sphn's reader, in any chunking."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest
import soxr
import sphn

from duplexserve.codecs import AudioFormat, make_decoder, make_encoder
from duplexserve.codecs import libopus as lo
from duplexserve.codecs.formats import MODEL_RATE, FormatError
from duplexserve.codecs.opus_reader import LibopusStreamDecoder
from duplexserve.codecs.procpool import CodecProcesses
from tests.test_codecs import align, chunks, frames_of, speech16k, sweep, tone  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(lo.LIBOPUS is None, reason="libopus cannot be loaded")


def streams(x: np.ndarray) -> dict[str, list[bytes]]:
    """The same audio through both Ogg writers: ours (libopus) and sphn's."""
    ours, theirs = lo.LibopusStreamEncoder(5), sphn.OpusStreamWriter(MODEL_RATE)
    frames = list(frames_of(x))
    return {"libopus": [ours.encode(f) for f in frames], "sphn": [theirs.append_pcm(f) for f in frames]}


def raw_page(payload: bytes, lacing: bytes, seq: int, flags: int = 0) -> bytes:
    """An Ogg page with the lacing given (``lo.ogg_page`` always ends its packet)."""
    page = bytearray(lo._PAGE_HEADER.pack(b"OggS", 0, flags, -1, lo.SERIAL, seq, 0))
    page += bytes([len(lacing)]) + lacing + payload
    page[22:26] = lo.ogg_crc(bytes(page)).to_bytes(4, "little")
    return bytes(page)


def decode_all(dec, pieces: list[bytes]) -> np.ndarray:
    return np.concatenate([dec.decode(p) for p in pieces] + [dec.flush()])


@pytest.mark.parametrize("writer", ["libopus", "sphn"])
@pytest.mark.parametrize("cuts", [[10**6], [1], [7], [57, 4000, 300], [27], [28, 1]])
def test_same_samples_as_sphns_reader_in_any_chunking(speech16k, writer, cuts):  # noqa: F811
    """Bit for bit: both call libopus's float decoder on the same packets; any cut of the
    stream (inside a header, between lacing values, inside a packet) gives the same."""
    x = soxr.resample(speech16k, 16000, MODEL_RATE).astype(np.float32)
    messages = streams(x)[writer]
    reader = sphn.OpusStreamReader(MODEL_RATE)
    reference = np.concatenate([reader.append_bytes(m) for m in messages])
    got = decode_all(LibopusStreamDecoder(), chunks(b"".join(messages), cuts))
    assert got.dtype == np.float32 and np.array_equal(got, reference)


def test_message_by_message_one_frame_each_from_the_first():
    messages = streams(tone(440, 0.8))["libopus"]
    dec = LibopusStreamDecoder()
    assert [len(dec.decode(m)) for m in messages] == [1920] * len(messages)  # pre-skip kept, as sphn


def test_round_trip_correlates_at_the_lookahead(speech16k):  # noqa: F811
    x = soxr.resample(speech16k, 16000, MODEL_RATE).astype(np.float32)
    y = decode_all(LibopusStreamDecoder(), streams(x)["libopus"])
    lag = align(x, y, 2000)
    assert abs(lag - lo.LibopusEncoder(5).lookahead) <= 3
    n = len(y) - lag
    assert np.corrcoef(x[:n], y[lag : lag + n])[0, 1] > 0.85


def test_packets_continued_across_pages():
    """A packet over 255 bytes laces as 255, 255, ...; one split over two pages (the first
    ending on a 255 lacing value) must come out whole."""
    enc = lo.LibopusStreamEncoder(5)
    head = enc.encode(np.zeros(0, np.float32))  # only the OpusHead and OpusTags pages
    packet = lo.LibopusEncoder(5).encode(sweep(MODEL_RATE, 0.04, 300, 3000)[:960])
    big = packet * 3  # not a valid Opus packet, but a valid Ogg packet
    first = raw_page(big[:510], bytes([255, 255]), seq=2)  # ends on 255: continued
    rest = big[510:]
    second = raw_page(rest, bytes([255] * (len(rest) // 255) + [len(rest) % 255]), seq=3, flags=0x01)
    dec = LibopusStreamDecoder()
    assert dec.packets(head + first) == []
    assert dec.packets(second) == [big]


def test_a_new_stream_starts_over():
    """Two streams one after the other (a client that restarts): each with its head."""
    x = tone(500, 0.4)
    a, b = streams(x)["libopus"], streams(x)["libopus"]
    dec = LibopusStreamDecoder()
    y1, y2 = decode_all(dec, a), decode_all(dec, b)
    assert np.array_equal(y1, y2)


@pytest.mark.parametrize("data, message", [
    (b"RIFF....", "OggS"),
    (np.zeros(1920, np.float32).tobytes(), "OggS"),
])
def test_refuses_what_is_not_ogg(data, message):
    with pytest.raises(FormatError, match=message):
        LibopusStreamDecoder().decode(data)


def test_refuses_a_stream_without_opus_head_or_with_garbage_between_pages():
    page = lo.ogg_page(b"NotOpus!" + bytes(11), 0, 1, 0, flags=0x02)
    with pytest.raises(FormatError, match="OpusHead"):
        LibopusStreamDecoder().decode(page)
    messages = streams(tone(300, 0.24))["libopus"]
    dec = LibopusStreamDecoder()
    dec.decode(messages[0])
    with pytest.raises(FormatError, match="Ogg"):
        dec.decode(b"junk" + messages[1])


def test_the_server_path_and_a_codec_process_use_it():
    assert isinstance(make_decoder(AudioFormat("opus")), LibopusStreamDecoder)
    messages = streams(tone(900, 0.4))["libopus"]

    async def main():
        procs = CodecProcesses(1)
        try:
            dec = make_decoder(AudioFormat("opus"), procs)
            return [await dec.decode_async(m) for m in messages]
        finally:
            procs.close()

    local = LibopusStreamDecoder()
    assert all(np.array_equal(a, local.decode(m)) for a, m in zip(asyncio.run(main()), messages, strict=True))


def test_without_libopus_sphn_decodes():
    code = ("from duplexserve.codecs import AudioFormat, make_decoder\n"
            "from duplexserve.codecs.opus import OpusStreamDecoder\n"
            "assert isinstance(make_decoder(AudioFormat('opus')), OpusStreamDecoder)\n")
    env = {**os.environ, "DUPLEXSERVE_NO_LIBOPUS": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_encoder_round_trip_through_make_encoder_and_make_decoder():
    x = sweep(MODEL_RATE, 1.0, 200, 3000)
    enc, dec = make_encoder(AudioFormat("opus")), make_decoder(AudioFormat("opus"))
    frames = frames_of(x)
    y = np.concatenate([dec.decode(enc.encode(f)) for f in frames])
    assert len(y) == len(frames) * len(frames[0])
    lag = align(x, y, 2000)
    n = len(y) - lag
    assert np.corrcoef(x[:n], y[lag : lag + n])[0, 1] > 0.8
