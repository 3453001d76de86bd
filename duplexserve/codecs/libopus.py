"""Ogg/Opus output through libopus directly (ctypes), with a settable complexity.

sphn's writer encodes with libopus's defaults (complexity 10, VoIP mode), about 1.3 ms of
CPU per 80 ms frame of speech. The same libopus in OPUS_APPLICATION_AUDIO mode costs
about a seventh of that at complexity 5 and a sixteenth at complexity 0 (Kyutai's web
client encodes at 0). This module binds just the encoder calls it needs and writes the
Ogg stream itself, with the layout of sphn's writer (``opus.OpusStreamEncoder``): the
first message carries the OpusHead and OpusTags pages, then every 80 ms model frame
becomes two 40 ms packets, one Ogg page each, granule positions in 48 kHz samples.

``LIBOPUS`` is None when libopus cannot be loaded; ``opus_choice.make_opus_encoder`` then falls back
to sphn (one log line). ctypes releases the GIL during each call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import struct
import zlib

import numpy as np

from duplexserve.codecs.formats import MODEL_RATE

log = logging.getLogger(__name__)

OPUS_APPLICATION_AUDIO = 2049
OPUS_SET_BITRATE = 4002
OPUS_SET_COMPLEXITY = 4010
OPUS_GET_LOOKAHEAD = 4027
OPUS_OK = 0
DEFAULT_COMPLEXITY = 5
PACKET_SAMPLES = 960  # 40 ms at 24 kHz, one packet per Ogg page
_GRANULE_STEP = PACKET_SAMPLES * 48000 // MODEL_RATE  # 1920: granule positions count 48 kHz samples
_MAX_PACKET = 4000  # libopus's recommended output buffer
VENDOR = b"duplexserve"
#: One logical stream per connection, never chained: a fixed serial (sphn uses 42) keeps
#: the output deterministic, so a codec process and an inline encoder agree byte for byte.
SERIAL = 0x44555058


def _load() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("opus")
    candidates = [name] if name else []
    candidates.append("libopus.so.0")  # find_library needs ldconfig or gcc; the soname may still load
    for cand in candidates:
        try:
            return bind(ctypes.CDLL(cand))
        except OSError:
            continue
    return None


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the prototypes of the libopus calls the codecs make (any copy of libopus)."""
    lib.opus_encoder_create.restype = ctypes.c_void_p
    lib.opus_encoder_create.argtypes = [ctypes.c_int32, ctypes.c_int, ctypes.c_int,
                                        ctypes.POINTER(ctypes.c_int)]  # fmt: skip
    lib.opus_encoder_destroy.restype = None
    lib.opus_encoder_destroy.argtypes = [ctypes.c_void_p]
    lib.opus_encode_float.restype = ctypes.c_int32
    lib.opus_encode_float.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                      ctypes.c_int32]  # fmt: skip
    lib.opus_encoder_ctl.restype = ctypes.c_int
    lib.opus_decoder_create.restype = ctypes.c_void_p
    lib.opus_decoder_create.argtypes = [ctypes.c_int32, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.opus_decoder_destroy.restype = None
    lib.opus_decoder_destroy.argtypes = [ctypes.c_void_p]
    lib.opus_decode_float.restype = ctypes.c_int
    lib.opus_decode_float.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.c_void_p,
                                      ctypes.c_int, ctypes.c_int]  # fmt: skip
    lib.opus_packet_get_nb_samples.restype = ctypes.c_int
    lib.opus_packet_get_nb_samples.argtypes = [ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32]
    # opus_encoder_ctl is variadic: its argtypes stay unset, arguments are
    # passed as explicit c_int / pointer values at each call.
    return lib


LIBOPUS = None if os.environ.get("DUPLEXSERVE_NO_LIBOPUS") else _load()


# ---------------------------------------------------------------------------- Ogg
def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        r = i << 24
        for _ in range(8):
            r = ((r << 1) ^ 0x04C11DB7) if r & 0x80000000 else (r << 1)
        table.append(r & 0xFFFFFFFF)
    return table


_CRC_TABLE = _crc_table()


def ogg_crc_table(data: bytes) -> int:
    """Ogg's CRC32: polynomial 0x04C11DB7, no reflection, initial value and final xor 0.
    Table-driven in Python: the reference ``ogg_crc`` is checked against (about 45 us for
    a 360-byte page, a third of a frame's encoding at complexity 0)."""
    crc, table = 0, _CRC_TABLE
    for b in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ table[(crc >> 24) ^ b]
    return crc


_REVERSE_BITS = bytes(int(f"{i:08b}"[::-1], 2) for i in range(256))
_ZERO_CRCS: dict[int, int] = {}  # zlib.crc32 of n zero bytes, by n (pages are under 64 KiB)


def ogg_crc(data: bytes | bytearray) -> int:
    """The same CRC through zlib's table-driven C code, about 1 us a page. zlib computes
    the bit-reflected CRC of the same polynomial with initial value and final xor
    0xFFFFFFFF: reflect every byte in, reflect the result out, and cancel the initial
    value by xoring the CRC of as many zero bytes (the CRC is affine in its input)."""
    n = len(data)
    zeros = _ZERO_CRCS.get(n)
    if zeros is None:
        zeros = _ZERO_CRCS[n] = zlib.crc32(bytes(n))
    reflected = zlib.crc32(data.translate(_REVERSE_BITS)) ^ zeros
    return int.from_bytes(reflected.to_bytes(4, "little").translate(_REVERSE_BITS), "big")


_PAGE_HEADER = struct.Struct("<4sBBqIII")  # capture, version, flags, granule, serial, seq, crc
_CRC = struct.Struct("<I")


def ogg_page(payload: bytes, granule: int, serial: int, seq: int, flags: int = 0) -> bytes:
    """One Ogg page holding one whole packet (under 64 KiB). Built by bytes concatenation
    (a frame's two pages are on the codec's per-frame path: a few microseconds each)."""
    n = len(payload)
    full = n // 255
    lacing = bytes((full + 1,)) + b"\xff" * full + bytes((n - 255 * full,))
    page = _PAGE_HEADER.pack(b"OggS", 0, flags, granule, serial, seq, 0) + lacing + payload
    return page[:22] + _CRC.pack(ogg_crc(page)) + page[26:]


# --------------------------------------------------------------------------- encoder
class LibopusEncoder:
    """One libopus encoder at 24 kHz mono (application AUDIO, the given complexity)."""

    def __init__(self, complexity: int = DEFAULT_COMPLEXITY, bitrate: int | None = None) -> None:
        if LIBOPUS is None:
            raise RuntimeError("libopus could not be loaded")
        if not 0 <= complexity <= 10:
            raise ValueError("opus complexity must be 0..10")
        err = ctypes.c_int(0)
        self._lib = LIBOPUS
        self._st = LIBOPUS.opus_encoder_create(MODEL_RATE, 1, OPUS_APPLICATION_AUDIO, ctypes.byref(err))
        if err.value != OPUS_OK or not self._st:
            raise RuntimeError(f"opus_encoder_create failed ({err.value})")
        self._ctl(OPUS_SET_COMPLEXITY, complexity)
        if bitrate is not None:
            self._ctl(OPUS_SET_BITRATE, bitrate)
        lookahead = ctypes.c_int32(0)
        if LIBOPUS.opus_encoder_ctl(ctypes.c_void_p(self._st), ctypes.c_int(OPUS_GET_LOOKAHEAD),
                                    ctypes.byref(lookahead)) != OPUS_OK:
            raise RuntimeError("OPUS_GET_LOOKAHEAD failed")
        self.lookahead = lookahead.value  # samples at 24 kHz
        self._out = ctypes.create_string_buffer(_MAX_PACKET)
        self._encode = LIBOPUS.opus_encode_float

    def _ctl(self, request: int, value: int) -> None:
        st = ctypes.c_void_p(self._st)
        rc = self._lib.opus_encoder_ctl(st, ctypes.c_int(request), ctypes.c_int32(value))
        if rc != OPUS_OK:
            raise RuntimeError(f"opus_encoder_ctl({request}, {value}) failed ({rc})")

    def encode(self, pcm: np.ndarray) -> bytes:
        """One packet of exactly PACKET_SAMPLES contiguous float32 samples."""
        return self.encode_at(pcm.ctypes.data)

    def encode_at(self, address: int) -> bytes:
        """One packet of the PACKET_SAMPLES float32 samples at ``address``."""
        n = self._encode(self._st, address, PACKET_SAMPLES, self._out, _MAX_PACKET)
        if n < 0:
            raise RuntimeError(f"opus_encode_float failed ({n})")
        return ctypes.string_at(self._out, n)  # .raw[:n] would copy all 4000 bytes first

    def __del__(self) -> None:
        st, self._st = getattr(self, "_st", None), None
        if st:
            self._lib.opus_encoder_destroy(st)


def opus_head(pre_skip: int, input_rate: int = MODEL_RATE) -> bytes:
    return b"OpusHead" + struct.pack("<BBHIhB", 1, 1, pre_skip, input_rate, 0, 0)


def opus_tags() -> bytes:
    return b"OpusTags" + struct.pack("<I", len(VENDOR)) + VENDOR + struct.pack("<I", 0)


class LibopusStreamEncoder:
    """One model frame in, the Ogg pages of its two 40 ms Opus packets out (sphn's layout)."""

    inline = True  # ctypes releases the GIL, but a frame costs less than a thread hop
    remote = False

    def __init__(self, complexity: int = DEFAULT_COMPLEXITY, serial: int = SERIAL) -> None:
        self._enc = LibopusEncoder(complexity)
        self.complexity = complexity
        self.serial = serial
        self.pre_skip = self._enc.lookahead * 48000 // MODEL_RATE
        self._seq = 0
        self._granule = 0
        self._pending = np.zeros(0, dtype=np.float32)
        self._head: bytes | None = (
            self._page(opus_head(self.pre_skip), 0, flags=0x02) + self._page(opus_tags(), 0)
        )

    def _page(self, payload: bytes, granule: int, flags: int = 0) -> bytes:
        page = ogg_page(payload, granule, self.serial, self._seq, flags)
        self._seq += 1
        return page

    def encode(self, frame: np.ndarray) -> bytes:
        x = np.ascontiguousarray(frame, dtype=np.float32)
        if len(self._pending):
            x = np.concatenate([self._pending, x])
        out = [self._head] if self._head is not None else []
        self._head = None
        packets = len(x) // PACKET_SAMPLES
        address, encode_at = x.ctypes.data, self._enc.encode_at
        for k in range(packets):
            packet = encode_at(address + 4 * PACKET_SAMPLES * k)
            self._granule += _GRANULE_STEP
            out.append(ogg_page(packet, self._granule, self.serial, self._seq))
            self._seq += 1
        whole = packets * PACKET_SAMPLES
        self._pending = x[whole:].copy() if whole < len(x) else _NO_SAMPLES
        return b"".join(out)


_NO_SAMPLES = np.zeros(0, dtype=np.float32)
