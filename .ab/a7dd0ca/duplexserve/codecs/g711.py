"""G.711 mu-law and A-law as table lookups: one numpy gather per message, both ways.

Decoding indexes a 256-entry float32 table with the code bytes. Encoding rounds the
float samples to 16-bit PCM and indexes a 65536-entry code table with them. The tables
are built once, vectorised, from the ITU-T G.711 segment rules as in Sun's reference
``g711.c`` (the code CPython's ``audioop`` used), so the codes match that reference bit
for bit: mu-law looks at the top 14 bits of the 16-bit sample, A-law at the top 13.
"""

from __future__ import annotations

import numpy as np

from duplexserve.codecs import pcm

_SCALE = np.float32(1 / 32768)
_ALL_S16 = np.arange(-32768, 32768, dtype=np.int32)  # index i holds the sample i - 32768


def _ulaw_encode_table() -> np.ndarray:
    """Code of every 16-bit sample, indexed by the sample's bits read as uint16."""
    v = _ALL_S16 >> 2  # 14-bit
    mask = np.where(v < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(v), 8159) + (0x84 >> 2)
    seg = np.searchsorted(np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF]), mag)
    code = np.where(seg >= 8, 0x7F, (np.minimum(seg, 7) << 4) | ((mag >> (seg + 1)) & 0xF))
    return _by_bits((code ^ mask).astype(np.uint8))


def _alaw_encode_table() -> np.ndarray:
    v = _ALL_S16 >> 3  # 13-bit
    mask = np.where(v >= 0, 0xD5, 0x55)
    mag = np.where(v >= 0, v, -v - 1)
    seg = np.searchsorted(np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF]), mag)
    quant = np.where(seg < 2, mag >> 1, mag >> np.maximum(seg, 1)) & 0xF
    code = (seg << 4) | quant  # |13-bit value| <= 0xFFF, so seg <= 7
    return _by_bits((code ^ mask).astype(np.uint8))


def _by_bits(table_by_value: np.ndarray) -> np.ndarray:
    """Reorder a table indexed by ``sample + 32768`` to one indexed by ``uint16(sample)``."""
    return np.roll(table_by_value, -32768)


def _ulaw_decode_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((u & 0x0F) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def _alaw_decode_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    seg = (a & 0x70) >> 4
    t = (a & 0x0F) << 4
    t = np.where(seg == 0, t + 8, np.where(seg == 1, t + 0x108, (t + 0x108) << np.maximum(seg - 1, 0)))
    return np.where(a & 0x80, t, -t).astype(np.int16)


#: 16-bit PCM value of each code, and the float32 the model sees for it.
ULAW_TO_S16 = _ulaw_decode_table()
ALAW_TO_S16 = _alaw_decode_table()
_ULAW_TO_F32 = ULAW_TO_S16.astype(np.float32) * _SCALE
_ALAW_TO_F32 = ALAW_TO_S16.astype(np.float32) * _SCALE
#: Code of each 16-bit sample, indexed by ``sample.view(np.uint16)``.
S16_TO_ULAW = _ulaw_encode_table()
S16_TO_ALAW = _alaw_encode_table()


def ulaw_to_f32(data: bytes | memoryview) -> np.ndarray:
    return _ULAW_TO_F32[np.frombuffer(data, dtype=np.uint8)]


def alaw_to_f32(data: bytes | memoryview) -> np.ndarray:
    return _ALAW_TO_F32[np.frombuffer(data, dtype=np.uint8)]


def f32_to_ulaw(samples: np.ndarray) -> bytes:
    return S16_TO_ULAW[pcm.f32_to_s16_array(samples).view(np.uint16)].tobytes()


def f32_to_alaw(samples: np.ndarray) -> bytes:
    return S16_TO_ALAW[pcm.f32_to_s16_array(samples).view(np.uint16)].tobytes()
