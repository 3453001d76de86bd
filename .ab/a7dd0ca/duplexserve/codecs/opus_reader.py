"""Ogg/Opus input through libopus directly (ctypes): an Ogg page reader of our own.

sphn's ``OpusStreamReader`` holds the GIL while it decodes and costs about 120 us a frame
of speech; libopus's ``opus_decode_float`` called through ctypes releases the GIL and,
with the Ogg pages parsed here, costs less (``duplexserve bench opus-cost``).
The output is what sphn's reader gives for the same bytes: every audio packet decoded
at 24 kHz mono in order, the pre-skip not removed (sphn keeps it too), nothing until a
packet is complete. Input may be cut anywhere: pages split across messages, several
pages in one message, packets continued across pages (lacing value 255 at a page end).

The first bytes must be ``OggS`` and the first packet an ``OpusHead``; anything else,
or a packet libopus refuses, raises ``FormatError`` (the session ends ``invalid_audio``).
A new stream (a BOS page) starts over with its own OpusHead and a fresh decoder.
"""

from __future__ import annotations

import ctypes

import numpy as np

from duplexserve.codecs.formats import MODEL_RATE, FormatError
from duplexserve.codecs.libopus import LIBOPUS, OPUS_OK

OGG_CAPTURE = b"OggS"
_HEADER = 27  # fixed part of a page header, before the lacing values
_FLAGS_BOS = 0x02
_MAX_FRAME = 2880  # 120 ms at 24 kHz: the longest Opus packet
_EMPTY = np.zeros(0, dtype=np.float32)


class LibopusStreamDecoder:
    """Ogg/Opus bytes of any chunking in, float32 at 24 kHz out (none until a packet ends)."""

    inline = True  # a frame costs less than a hop; in a codec process when one is configured
    remote = False

    def __init__(self) -> None:
        if LIBOPUS is None:
            raise RuntimeError("libopus could not be loaded")
        self._lib = LIBOPUS
        self._st: int | None = None
        self._buf = b""  # the start of an incomplete page
        self._partial = b""  # a packet continued on the next page
        self._headers = 0  # header packets (OpusHead, OpusTags) of the current stream seen
        self._checked = False

    def _open(self) -> None:
        self._close()
        err = ctypes.c_int(0)
        st = self._lib.opus_decoder_create(MODEL_RATE, 1, ctypes.byref(err))
        if err.value != OPUS_OK or not st:
            raise RuntimeError(f"opus_decoder_create failed ({err.value})")
        self._st = st

    def _close(self) -> None:
        st, self._st = self._st, None
        if st:
            self._lib.opus_decoder_destroy(st)

    def packets(self, data: bytes | memoryview) -> list[bytes]:
        """The audio packets completed by ``data`` (header packets consumed here).

        Works on immutable bytes (slicing them is cheap; a message usually holds whole
        pages) and keeps only an incomplete page's bytes for the next call.
        """
        buf = self._buf + data if self._buf else bytes(data)
        if not self._checked:
            if not OGG_CAPTURE.startswith(buf[:4]):
                raise FormatError("opus input must be an Ogg stream (starting with 'OggS')")
            self._checked = len(buf) >= 4
        out: list[bytes] = []
        pos, end = 0, len(buf)
        while end - pos >= _HEADER:
            if not buf.startswith(OGG_CAPTURE, pos):
                raise FormatError("invalid Ogg/Opus data: lost the Ogg page boundary")
            nseg = buf[pos + 26]
            body = pos + _HEADER + nseg
            if end < body:
                break
            lacing = buf[pos + _HEADER : body]
            page_end = body + sum(lacing)
            if page_end > end:
                break
            if buf[pos + 5] & _FLAGS_BOS:
                self._headers, self._partial = 0, b""
            if nseg == 1 and lacing[0] < 255 and not self._partial and self._headers == 2:
                out.append(buf[body:page_end])  # the common case: one whole packet a page
            else:
                self._page(buf, body, lacing, out)
            pos = page_end
        self._buf = buf[pos:] if pos < end else b""
        return out

    def _page(self, buf: bytes, start: int, lacing: bytes, out: list[bytes]) -> None:
        end = start
        for lace in lacing:
            end += lace
            if lace < 255:
                packet = buf[start:end]
                if self._partial:
                    packet, self._partial = self._partial + packet, b""
                self._packet(packet, out)
                start = end
        if start < end:  # the page ends inside a packet
            self._partial += buf[start:end]

    def _packet(self, packet: bytes, out: list[bytes]) -> None:
        if self._headers == 0:
            if not packet.startswith(b"OpusHead"):
                raise FormatError("invalid Ogg/Opus data: the stream does not start with OpusHead")
            self._open()
            self._headers = 1
        elif self._headers == 1:
            self._headers = 2  # OpusTags: nothing in it is needed
        else:
            out.append(packet)

    def decode(self, data: bytes | memoryview) -> np.ndarray:
        packets = self.packets(data)
        if not packets:
            return _EMPTY
        pcm = np.empty(_MAX_FRAME * len(packets), dtype=np.float32)
        base, n, decode, st = pcm.ctypes.data, 0, self._lib.opus_decode_float, self._st
        for packet in packets:
            got = decode(st, packet, len(packet), base + 4 * n, _MAX_FRAME, 0)
            if got < 0:
                raise FormatError(f"invalid Ogg/Opus data: libopus error {got}")
            n += got
        return pcm[:n]

    def flush(self) -> np.ndarray:
        return _EMPTY  # a packet is decoded as soon as it is complete; a partial one is lost

    def __del__(self) -> None:
        self._close()


def make_opus_decoder() -> LibopusStreamDecoder | object:
    """The libopus decoder when libopus loads, else sphn's reader (the same samples)."""
    if LIBOPUS is not None:
        return LibopusStreamDecoder()
    from duplexserve.codecs.opus import OpusStreamDecoder

    return OpusStreamDecoder()
