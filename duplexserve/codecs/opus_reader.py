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

What input may cost is bounded before anything is decoded (``OggOpusReader``): each
audio packet's TOC says how many samples it decodes to, and they are charged to the
connection's budget (``opus_budget.py``); an Ogg packet is at most ``MAX_PACKET_BYTES``.
Both refusals are ``OverBudget`` (a FormatError: the session ends ``invalid_audio``).
sphn's reader, the fallback, gets the same checks from an ``OggOpusReader`` in front.
"""

from __future__ import annotations

import ctypes

import numpy as np

from duplexserve.codecs.formats import MODEL_RATE, FormatError
from duplexserve.codecs.libopus import LIBOPUS, OPUS_OK
from duplexserve.codecs.opus_budget import OpusBudget, OverBudget, packet_samples

OGG_CAPTURE = b"OggS"
_HEADER = 27  # fixed part of a page header, before the lacing values
_FLAGS_BOS = 0x02
#: The longest Ogg packet taken, OpusHead and OpusTags included: an Opus packet is at
#: most 48 frames of 1275 bytes (RFC 6716 section 3.2.5), 61,200 bytes. A packet may go
#: on over any number of pages (lacing value 255 at each page's end), so without a cap
#: one that never ends grows the reader's memory without bound.
MAX_PACKET_BYTES = 65536
_UNLIMITED = 1 << 62
_EMPTY = np.zeros(0, dtype=np.float32)


class OggOpusReader:
    """Ogg pages of any chunking in, audio packets out, each charged to the budget.

    Works on immutable bytes (slicing them is cheap; a message usually holds whole
    pages) and keeps only an incomplete page (at most 65,307 bytes: 255 lacing values of
    255) and a packet continued on the next page (at most ``MAX_PACKET_BYTES``) for the
    next call.
    """

    def __init__(self, budget: OpusBudget | None = None) -> None:
        self._budget = budget
        self._buf = b""  # the start of an incomplete page
        self._partial = b""  # a packet continued on the next page
        self._headers = 0  # header packets (OpusHead, OpusTags) of the current stream seen
        self._checked = False
        self._left = _UNLIMITED  # samples the budget allows, during ``packets``
        self._refused: OverBudget | None = None  # once over a budget, for good
        self.sizes: list[int] = []  # samples of each packet the last ``packets`` returned

    def _stream_start(self) -> None:
        """An OpusHead began a stream (the libopus decoder opens a fresh state here)."""

    def packets(self, data: bytes | memoryview) -> list[bytes]:
        """The audio packets completed by ``data`` (header packets consumed here), their
        samples in ``sizes``; OverBudget before a packet would go over the budget, and
        on every call after that."""
        if self._refused is not None:
            raise self._refused
        try:
            return self._packets(data)
        except OverBudget as exc:
            self._refused = exc
            raise

    def _packets(self, data: bytes | memoryview) -> list[bytes]:
        budget = self._budget
        self._left = left = budget.left(len(data)) if budget is not None else _UNLIMITED
        self.sizes = []
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
                self._audio(buf[body:page_end], out)  # the common case: one whole packet a page
            else:
                self._page(buf, body, lacing, out)
            pos = page_end
        self._buf = buf[pos:] if pos < end else b""
        if budget is not None:
            budget.decoded += left - self._left
        return out

    def _page(self, buf: bytes, start: int, lacing: bytes, out: list[bytes]) -> None:
        end = start
        for lace in lacing:
            end += lace
            if lace < 255:
                packet = buf[start:end]
                if self._partial:
                    packet, self._partial = self._partial + packet, b""
                    self._check_size(len(packet))
                self._packet(packet, out)
                start = end
        if start < end:  # the page ends inside a packet
            self._check_size(len(self._partial) + end - start)
            self._partial += buf[start:end]

    @staticmethod
    def _check_size(size: int) -> None:
        if size > MAX_PACKET_BYTES:
            raise OverBudget("ogg_packet", f"an Ogg packet over {MAX_PACKET_BYTES} bytes (no Opus packet is)")

    def _packet(self, packet: bytes, out: list[bytes]) -> None:
        if self._headers == 0:
            if not packet.startswith(b"OpusHead"):
                raise FormatError("invalid Ogg/Opus data: the stream does not start with OpusHead")
            self._stream_start()
            self._headers = 1
        elif self._headers == 1:
            self._headers = 2  # OpusTags: nothing in it is needed
        else:
            self._audio(packet, out)

    def _audio(self, packet: bytes, out: list[bytes]) -> None:
        """One audio packet, its TOC read and its samples charged before it is kept."""
        samples = packet_samples(packet)
        self._left -= samples
        if self._left < 0:
            assert self._budget is not None
            raise self._budget.refusal(sum(self.sizes) + samples)
        out.append(packet)
        self.sizes.append(samples)


class LibopusStreamDecoder(OggOpusReader):
    """Ogg/Opus bytes of any chunking in, float32 at 24 kHz out (none until a packet ends)."""

    inline = True  # a frame costs less than a hop; in a codec process when one is configured
    remote = False

    def __init__(self, budget: OpusBudget | None = None) -> None:
        self._st: int | None = None
        if LIBOPUS is None:
            raise RuntimeError("libopus could not be loaded")
        super().__init__(budget)
        self._lib = LIBOPUS

    def _stream_start(self) -> None:
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

    def decode(self, data: bytes | memoryview) -> np.ndarray:
        packets = self.packets(data)
        if not packets:
            return _EMPTY
        sizes = self.sizes
        pcm = np.empty(sum(sizes), dtype=np.float32)
        base, n, decode, st = pcm.ctypes.data, 0, self._lib.opus_decode_float, self._st
        for packet, size in zip(packets, sizes):  # noqa: B905 (one size per packet)
            # The TOC's duration as the room: libopus decodes no more than the packet says.
            got = decode(st, packet, len(packet), base + 4 * n, size, 0)
            if got < 0:
                raise FormatError(f"invalid Ogg/Opus data: libopus error {got}")
            n += got
        return pcm[:n]

    def flush(self) -> np.ndarray:
        return _EMPTY  # a packet is decoded as soon as it is complete; a partial one is lost

    def __del__(self) -> None:
        self._close()
