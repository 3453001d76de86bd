"""Opus as RTP carries it (WebRTC): bare packets, no Ogg, loss concealed by libopus.

WebRTC's Opus runs a 48 kHz RTP clock whatever the audio inside, and libopus decodes any
Opus packet at any of its rates and encodes from any of them: so the model's 24 kHz goes
in and comes out here without a resampler. The decoder also fills the gaps a network
leaves: ``conceal`` is libopus's packet-loss concealment (a lost packet's duration
decoded from nothing), ``recover`` decodes the forward error correction (LBRR) a sender
puts into the packet after a lost one. Both cost about what a decode costs.

libopus comes from the system (``libopus.LIBOPUS``) or, where the system has none, from
the copy bundled in PyAV's wheel, which aiortc (the WebRTC stack) installs anyway.
"""

from __future__ import annotations

import ctypes
import glob
import os

import numpy as np

from duplexserve.codecs.formats import MODEL_RATE
from duplexserve.codecs.libopus import (
    LIBOPUS,
    OPUS_APPLICATION_AUDIO,
    OPUS_OK,
    OPUS_SET_BITRATE,
    OPUS_SET_COMPLEXITY,
    bind,
)

OPUS_SET_INBAND_FEC = 4012
OPUS_SET_PACKET_LOSS_PERC = 4014
RTP_RATE = 48000  # Opus's RTP clock (RFC 7587), whatever the audio's own rate
PACKET_MS = 20  # what browsers send and expect
PACKET_SAMPLES = MODEL_RATE * PACKET_MS // 1000  # 480 at 24 kHz
MAX_PACKET_SAMPLES = MODEL_RATE * 120 // 1000  # the longest Opus packet, 120 ms
_MAX_BYTES = 1500


def _bundled() -> ctypes.CDLL | None:
    """PyAV's own libopus (av.libs/libopus-*.so*), when the system has none."""
    try:
        import av  # only for where it lies: the wheel's bundled libraries
    except ImportError:
        return None
    here = os.path.dirname(os.path.dirname(av.__file__))
    for path in sorted(glob.glob(os.path.join(here, "av.libs", "libopus*.so*"))):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


_LIB = LIBOPUS if LIBOPUS is not None else _bundled()
OPUS: ctypes.CDLL | None = bind(_LIB) if _LIB is not None else None


def _lib() -> ctypes.CDLL:
    if OPUS is None:
        raise RuntimeError("libopus could not be loaded (install libopus0, or PyAV for its bundled copy)")
    return OPUS


def packet_samples(packet: bytes) -> int:
    """How many 48 kHz samples (RTP timestamp units) the Opus packet holds; 0 if invalid."""
    n = _lib().opus_packet_get_nb_samples(packet, len(packet), RTP_RATE)
    return max(n, 0)


class RtpOpusDecoder:
    """Bare Opus packets in, 24 kHz mono float32 out; gaps concealed or recovered."""

    def __init__(self) -> None:
        lib = _lib()
        err = ctypes.c_int(0)
        self._lib = lib
        self._st = lib.opus_decoder_create(MODEL_RATE, 1, ctypes.byref(err))
        if err.value != OPUS_OK or not self._st:
            raise RuntimeError(f"opus_decoder_create failed ({err.value})")
        self._out = np.empty(MAX_PACKET_SAMPLES, dtype=np.float32)
        self._address = self._out.ctypes.data

    def _run(self, data: bytes | None, samples: int, fec: int) -> np.ndarray:
        n = self._lib.opus_decode_float(
            self._st, data, len(data) if data else 0, self._address, samples, fec
        )
        if n < 0:
            raise ValueError(f"opus_decode_float failed ({n})")
        return self._out[:n].copy()

    def decode(self, packet: bytes) -> np.ndarray:
        """One received packet."""
        return self._run(packet, MAX_PACKET_SAMPLES, 0)

    def conceal(self, samples: int = PACKET_SAMPLES) -> np.ndarray:
        """``samples`` (24 kHz, a multiple of 2.5 ms) of packet-loss concealment."""
        return self._run(None, samples, 0)

    def recover(self, next_packet: bytes, samples: int = PACKET_SAMPLES) -> np.ndarray:
        """The lost packet before ``next_packet`` from its in-band FEC (concealment if it
        carries none); ``next_packet`` itself is then decoded as usual."""
        return self._run(next_packet, samples, 1)

    def __del__(self) -> None:
        st, self._st = getattr(self, "_st", None), None
        if st:
            self._lib.opus_decoder_destroy(st)


class RtpOpusEncoder:
    """24 kHz mono float32 in, one bare Opus packet per 20 ms out (application AUDIO, as
    the Ogg encoder). ``fec``: in-band FEC, so a receiver that lost a packet can rebuild
    it from the next one; it costs: about 0.25 ms of CPU per 80 ms at complexity 5
    without, up to 1 ms with (it forces libopus's SILK layer), measured on the 2-core
    machine with ``opus_rtp`` in a loop."""

    def __init__(
        self, complexity: int = 5, fec: bool = False, loss_percent: int = 10, bitrate: int | None = None
    ) -> None:
        lib = _lib()
        err = ctypes.c_int(0)
        self._lib = lib
        self._st = lib.opus_encoder_create(MODEL_RATE, 1, OPUS_APPLICATION_AUDIO, ctypes.byref(err))
        if err.value != OPUS_OK or not self._st:
            raise RuntimeError(f"opus_encoder_create failed ({err.value})")
        self._ctl(OPUS_SET_COMPLEXITY, complexity)
        if fec:
            self._ctl(OPUS_SET_INBAND_FEC, 1)
            self._ctl(OPUS_SET_PACKET_LOSS_PERC, loss_percent)
        if bitrate is not None:
            self._ctl(OPUS_SET_BITRATE, bitrate)
        self._buf = ctypes.create_string_buffer(_MAX_BYTES)

    def _ctl(self, request: int, value: int) -> None:
        st = ctypes.c_void_p(self._st)
        rc = self._lib.opus_encoder_ctl(st, ctypes.c_int(request), ctypes.c_int32(value))
        if rc != OPUS_OK:
            raise RuntimeError(f"opus_encoder_ctl({request}, {value}) failed ({rc})")

    def encode(self, pcm: np.ndarray, packet: int = PACKET_SAMPLES) -> list[bytes]:
        """A whole number of packets of ``packet`` float32 samples (20 ms; 40, 60 or 80 ms
        where the peer takes them) -> that many packets."""
        x = np.ascontiguousarray(pcm, dtype=np.float32)
        if len(x) % packet:
            raise ValueError(f"{len(x)} samples is not a whole number of {packet}-sample packets")
        address, out, encode = x.ctypes.data, [], self._lib.opus_encode_float
        for k in range(len(x) // packet):
            n = encode(self._st, address + 4 * packet * k, packet, self._buf, _MAX_BYTES)
            if n < 0:
                raise RuntimeError(f"opus_encode_float failed ({n})")
            out.append(ctypes.string_at(self._buf, n))
        return out

    def __del__(self) -> None:
        st, self._st = getattr(self, "_st", None), None
        if st:
            self._lib.opus_encoder_destroy(st)
