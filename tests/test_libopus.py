"""The libopus (ctypes) Ogg/Opus writer: decoded by sphn, pages and headers checked by hand."""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import soxr
import sphn

from duplexserve.codecs import AudioFormat, make_encoder
from duplexserve.codecs import libopus as lo
from duplexserve.codecs.formats import FRAME_SAMPLES, MODEL_RATE
from duplexserve.codecs.procpool import CodecProcesses
from duplexserve.config import ServerConfig
from tests.test_codecs import align, chunks, frames_of, speech16k, sweep, tone  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(lo.LIBOPUS is None, reason="libopus cannot be loaded")


def bitwise_crc(data: bytes) -> int:
    """Ogg's CRC32 bit by bit: no table, no zlib (libopus.ogg_crc goes through zlib)."""
    crc = 0
    for byte in data:
        crc ^= byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) & 0xFFFFFFFF if crc & 0x80000000 else (crc << 1) & 0xFFFFFFFF
    return crc


def split_pages(stream: bytes) -> list[dict]:
    """Parse an Ogg stream page by page (each page's length from its own lacing)."""
    pages, pos = [], 0
    while pos < len(stream):
        assert stream[pos : pos + 4] == b"OggS"
        version, flags, granule, serial, seq, crc, nseg = struct.unpack_from("<BBqIIIB", stream, pos + 4)
        lacing = stream[pos + 27 : pos + 27 + nseg]
        end = pos + 27 + nseg + sum(lacing)
        raw = stream[pos:end]
        pages.append({"version": version, "flags": flags, "granule": granule, "serial": serial, "seq": seq,
                      "crc": crc, "payload": raw[27 + nseg :], "raw": raw})
        pos = end
    assert pos == len(stream)
    return pages


def zeroed_crc(raw: bytes) -> bytes:
    return raw[:22] + b"\0\0\0\0" + raw[26:]


def encode(x: np.ndarray, complexity: int) -> list[bytes]:
    enc = lo.LibopusStreamEncoder(complexity)
    return [enc.encode(f) for f in frames_of(x)]


def sphn_decode(messages: list[bytes], pieces: list[int]) -> np.ndarray:
    reader = sphn.OpusStreamReader(MODEL_RATE)
    return np.concatenate([reader.append_bytes(m) for m in chunks(b"".join(messages), pieces)])


def test_the_server_path_uses_libopus_at_the_configured_complexity():
    assert isinstance(make_encoder(AudioFormat("opus")), lo.LibopusStreamEncoder)
    default = ServerConfig().opus_complexity
    assert make_encoder(AudioFormat("opus")).complexity == lo.DEFAULT_COMPLEXITY == default
    assert make_encoder(AudioFormat("opus"), CodecProcesses(0, 0)).complexity == 0


@pytest.mark.parametrize("complexity", [0, 5, 10])
def test_sphn_decodes_it_back_to_the_speech(speech16k, complexity):  # noqa: F811
    x = soxr.resample(speech16k, 16000, MODEL_RATE).astype(np.float32)
    messages = encode(x, complexity)
    y = sphn_decode(messages, [57, 4000, 300])
    assert len(y) == len(x) // FRAME_SAMPLES * FRAME_SAMPLES
    lag = align(x, y, 2000)
    assert abs(lag - lo.LibopusEncoder(complexity).lookahead) <= 3  # sphn's reader keeps the pre-skip
    n = len(y) - lag
    assert np.corrcoef(x[:n], y[lag : lag + n])[0, 1] > 0.85  # the threshold of test_codecs


def test_sphn_decodes_a_sweep():
    x = sweep(MODEL_RATE, 2.0, 100, 4000)
    y = sphn_decode(encode(x, 0), [7])
    lag = align(x, y, 2000)
    assert np.corrcoef(x[: len(x) - lag], y[lag:])[0, 1] > 0.8


def test_pages_crcs_granules_and_sequence():
    messages = encode(tone(440, 0.8), 5)
    assert len(messages) == 10
    per_message = [split_pages(m) for m in messages]
    assert [len(p) for p in per_message] == [4] + [2] * 9  # headers, then one page per 40 ms packet
    pages = [p for ps in per_message for p in ps]
    for p in pages:
        assert p["version"] == 0 and p["serial"] == lo.SERIAL
        blank = zeroed_crc(p["raw"])
        assert p["crc"] == bitwise_crc(blank) == lo.ogg_crc_table(blank) == lo.ogg_crc(blank)
    assert [p["seq"] for p in pages] == list(range(len(pages)))
    assert [p["flags"] for p in pages] == [0x02] + [0] * (len(pages) - 1)  # BOS on the OpusHead page
    assert [p["granule"] for p in pages] == [0, 0] + [1920 * (i + 1) for i in range(len(pages) - 2)]


def test_opus_head_and_tags():
    enc = lo.LibopusStreamEncoder(0)
    head, tags = split_pages(enc.encode(tone(440, 0.08)))[:2]
    magic, version, channels, pre_skip, rate, gain, mapping = struct.unpack("<8sBBHIhB", head["payload"])
    assert (magic, version, channels, rate, gain, mapping) == (b"OpusHead", 1, 1, 24000, 0, 0)
    assert pre_skip == enc.pre_skip == 2 * lo.LibopusEncoder(0).lookahead > 0  # 48 kHz samples
    body = tags["payload"]
    assert body[:8] == b"OpusTags"
    (n,) = struct.unpack_from("<I", body, 8)
    assert body[12 : 12 + n] == b"duplexserve" and struct.unpack_from("<I", body, 12 + n) == (0,)
    assert len(body) == 16 + n


def test_table_crc_matches_the_crc_of_sphns_pages():
    """A known-good Ogg writer (sphn's) as the reference for the CRC."""
    stream = sphn.OpusStreamWriter(MODEL_RATE).append_pcm(tone(300, 0.08))
    for p in split_pages(stream):
        assert p["crc"] == lo.ogg_crc(zeroed_crc(p["raw"]))
    lacing = lo.ogg_page(b"x" * 600, 7, 1, 2)  # a packet over 255 bytes: 255, 255, 90
    assert lacing[26:30] == bytes([3, 255, 255, 90]) and split_pages(lacing)[0]["payload"] == b"x" * 600


def test_complexity_changes_the_packets_and_is_validated():
    x = tone(440, 0.4)
    assert encode(x, 0) != encode(x, 10)
    with pytest.raises(ValueError):
        lo.LibopusStreamEncoder(11)
    for bad in (-1, 11):
        with pytest.raises(ValueError, match="opus_complexity"):
            ServerConfig(opus_complexity=bad).validate()


def test_codec_process_encodes_at_the_configured_complexity():
    x = tone(700, 0.4)

    async def main():
        procs = CodecProcesses(1, 0)
        try:
            enc = make_encoder(AudioFormat("opus"), procs)
            return [await enc.encode_async(f) for f in frames_of(x)]
        finally:
            procs.close()

    assert asyncio.run(main()) == encode(x, 0)


def test_without_libopus_sphn_encodes():
    code = ("from duplexserve.codecs import AudioFormat, make_encoder\n"
            "from duplexserve.codecs.opus import OpusStreamEncoder\n"
            "assert isinstance(make_encoder(AudioFormat('opus')), OpusStreamEncoder)\n")
    env = {**os.environ, "DUPLEXSERVE_NO_LIBOPUS": "1"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "libopus could not be loaded" in res.stderr
