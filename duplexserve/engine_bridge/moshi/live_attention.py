"""Decode attention over each row's live prefix of the KV ring, not its whole capacity.

moshi's ``RingKVCache`` writes a row's key and value at ``offset % capacity``, so a row
that has stepped ``n`` times holds valid entries in slots ``[0, min(n, capacity))`` and
nothing else; RoPE is applied before caching, so the order of the slots does not change
the sum. With ``capacity == context`` (the LM's case) moshi's mask keeps exactly that
prefix. Attending to the prefix alone is therefore the same computation, and it reads
``min(n, capacity)`` slots instead of all of them: a session one minute old reads a
quarter of a 3000-frame ring, an idle slot (length 0) reads nothing.

On CUDA a split-K Triton kernel (flash-decoding: each program takes one chunk of one
row's prefix, a second kernel merges the chunks' softmax partials) does the reading;
its grid is fixed by the capacity, so it replays inside a CUDA graph, and chunks past a
row's length cost one load of the length. An int8 ring (``--moshi-kv-dtype int8``) is
read as int32 words, each byte made a float without a conversion instruction
(``_partials_int8``), and written by one kernel a layer (``write_quantized``). Anywhere
else (the CPU, no Triton) the same prefix goes to ``scaled_dot_product_attention`` as a
boolean mask of moshi's own shape, which gives moshi's results bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # Triton comes with CUDA builds of torch; CPU builds run the fallback.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


@dataclass(frozen=True)
class KernelConfig:
    """Split size and tile shape of the partials kernel (chosen by measurement on an H200),
    and for an int8 ring how its bytes become floats (see ``_partials_int8``)."""

    chunk: int = 256  # keys per program: at capacity 3000 a row is at most 12 programs
    block_n: int = 32  # keys loaded per iteration of a program
    warps: int = 2
    stages: int = 3
    int8: str = "cast"  # "cast": int8 -> float32 a byte (the bf16 kernel's loop); "bits": ``_byte``

    def __post_init__(self) -> None:
        if self.int8 not in ("cast", "bits"):
            raise ValueError(f"int8 read {self.int8!r}: cast or bits")

    @classmethod
    def parse(cls, text: str) -> KernelConfig:
        """``chunk/block/warps/stages[/int8]``, as the benchmarks name a configuration."""
        fields = text.split("/")
        return cls(*(int(x) for x in fields[:4]), *fields[4:])  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"{self.chunk}/{self.block_n}/{self.warps}/{self.stages}/{self.int8}"


DEFAULT = KernelConfig()
DEFAULT_INT8 = KernelConfig(block_n=16, warps=1, int8="bits")  # 0.37 ms against 0.62 (cast) a layer at 384


def prefix_mask(lengths: torch.Tensor, capacity: int) -> torch.Tensor:
    """The boolean mask ``[B, 1, 1, capacity]`` that keeps each row's first ``length`` slots."""
    slots = torch.arange(capacity, device=lengths.device)
    return (slots.view(1, -1) < lengths.view(-1, 1))[:, None, None]


def reference_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The library's own attention call, with the prefix mask."""
    return F.scaled_dot_product_attention(q, keys, values, mask, dropout_p=0.0)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per vector of the last dimension (a slot of one head),
    rounded half away from zero like ``write_quantized``."""
    scale = x.abs().amax(dim=-1).float().clamp(min=1e-8) / 127.0
    y = x.float() / scale[..., None]
    q8 = (y.sign() * (y.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)
    return q8, scale.to(x.dtype)


def write_quantized(
    k: torch.Tensor, v: torch.Tensor, ring: torch.Tensor, scales: torch.Tensor, slot: torch.Tensor
) -> None:
    """``quantize`` this step's ``k`` and ``v`` (``[B, H, 1, D]``) into slot ``slot[b]`` of
    each row of the int8 ring ``[2, B, H, C, D]`` and its scales ``[2, B, H, C]``, in one
    kernel where the torch form takes a dozen small ones a layer."""
    b, h, _, d = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    _quantize_write[(b * h, 2)](
        k, v, ring, scales, slot,
        *k.stride()[:2], *v.stride()[:2], *ring.stride()[:4], *scales.stride(),
        h, D=d, num_warps=1,
    )  # fmt: skip


def dequantize(ring: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (ring.float() * scale.float()[..., None]).to(dtype)


def triton_available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def live_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Attention of one query per row over the first ``lengths[b]`` slots of row ``b``.

    ``q`` is ``[B, H, 1, D]``; ``keys`` and ``values`` are ``[B, H, C, D]`` views of the
    ring with ``D`` contiguous; ``lengths`` is ``[B]`` int32. A row of length 0 gets zeros.
    With ``scales`` (key and value scales, ``[B, H, C]`` each) the ring holds int8 and
    slot ``c`` of head ``h`` stands for ``ring * scale``, dequantized as it is read.
    """
    b, h, t, d = q.shape
    assert t == 1 and keys.stride(-1) == 1 and values.stride(-1) == 1
    config = config or (DEFAULT if scales is None else DEFAULT_INT8)
    capacity = keys.shape[2]
    splits = triton.cdiv(capacity, config.chunk)
    q2 = q.reshape(b * h, d) if q.is_contiguous() else q.contiguous().reshape(b * h, d)
    part_out = torch.empty((b * h, splits, d), device=q.device, dtype=torch.float32)
    part_max = torch.empty((b * h, splits), device=q.device, dtype=torch.float32)
    part_sum = torch.empty((b * h, splits), device=q.device, dtype=torch.float32)
    ring_strides = (*keys.stride()[:3], *values.stride()[:3])
    k_scale, v_scale = scales if scales is not None else (lengths, lengths)  # unread without scales
    scale_strides = (*k_scale.stride()[:2], *v_scale.stride()[:2]) if scales is not None else (0, 0, 0, 0)
    args = (q2, keys, values, k_scale, v_scale, lengths, part_out, part_max, part_sum,
            *ring_strides, *scale_strides, h, splits, 1.0 / math.sqrt(d))  # fmt: skip
    tiles = {"CHUNK": config.chunk, "BLOCK_N": config.block_n, "D": d,
             "num_warps": config.warps, "num_stages": config.stages}  # fmt: skip
    if scales is None or config.int8 == "cast":
        _partials[(b * h, splits)](*args, QUANT=scales is not None, **tiles)
    else:  # whole int32 words of the int8 ring: every offset a multiple of 4 bytes
        assert all(x % 4 == 0 for x in (d, *ring_strides, keys.data_ptr(), values.data_ptr()))
        _partials_int8[(b * h, splits)](*args, **tiles)
    out = torch.empty((b * h, d), device=q.device, dtype=q.dtype)
    _merge[(b * h,)](
        part_out, part_max, part_sum, out, splits,
        SPLITS=triton.next_power_of_2(splits), D=d, num_warps=4,
    )  # fmt: skip
    return out.view(b, h, 1, d)


if triton is not None:

    @triton.jit
    def _chunk(LENGTHS, heads, CHUNK: tl.constexpr):  # type: ignore[no-untyped-def]
        """This program's (row, head) and its chunk ``[start, end)`` of the row's live prefix."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        b = row // heads
        start = split * CHUNK
        return row, split, b, row % heads, start, tl.minimum(start + CHUNK, tl.load(LENGTHS + b))

    @triton.jit
    def _softmax_step(s, valid, m_i):  # type: ignore[no-untyped-def]
        """One tile of the running softmax: the new maximum, the rescale of what came
        before, and the tile's unnormalised weights (0 for keys past the chunk)."""
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        return m_new, tl.exp(m_i - m_new), tl.exp(s - m_new)

    @triton.jit
    def _partials(
        Q, K, V, K_SCALE, V_SCALE, LENGTHS, PART_OUT, PART_MAX, PART_SUM,
        stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc,
        stride_ksb, stride_ksh, stride_vsb, stride_vsh,
        heads, splits, scale,
        QUANT: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    ) -> None:  # fmt: skip
        """One chunk of one (row, head): its softmax max, sum and weighted value sum."""
        row, split, b, h, start, end = _chunk(LENGTHS, heads, CHUNK)
        d = tl.arange(0, D)
        q = tl.load(Q + row * D + d).to(tl.float32) * scale
        k_base = K + b.to(tl.int64) * stride_kb + h * stride_kh
        v_base = V + b.to(tl.int64) * stride_vb + h * stride_vh
        ks_base = K_SCALE + b.to(tl.int64) * stride_ksb + h * stride_ksh  # slots contiguous
        vs_base = V_SCALE + b.to(tl.int64) * stride_vsb + h * stride_vsh
        m_i = tl.full([], float("-inf"), tl.float32)
        l_i = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < end
            k = tl.load(k_base + n[:, None] * stride_kc + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
            if QUANT:
                s = s * tl.load(ks_base + n, mask=valid, other=0.0).to(tl.float32)
            m_new, alpha, p = _softmax_step(s, valid, m_i)
            v = tl.load(v_base + n[:, None] * stride_vc + d[None, :], mask=valid[:, None], other=0.0)
            pv = p
            if QUANT:
                pv = p * tl.load(vs_base + n, mask=valid, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(pv[:, None] * v.to(tl.float32), axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        part = row * splits + split
        tl.store(PART_OUT + part * D + d, acc)
        tl.store(PART_MAX + part, m_i)
        tl.store(PART_SUM + part, l_i)

    @triton.jit
    def _byte(w, i: tl.constexpr):  # type: ignore[no-untyped-def]
        """Byte ``i`` of each int32 word, an int8 ``x``, as float32, exactly: ``x + 128`` goes
        into the mantissa of 2**23 and one add takes the bias off. Integer-to-float
        conversions run at a fraction of an add's rate, and an int8 ring needs one a byte."""
        return (((w >> (8 * i)) & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0

    @triton.jit
    def _partials_int8(
        Q, K, V, K_SCALE, V_SCALE, LENGTHS, PART_OUT, PART_MAX, PART_SUM,
        stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc,
        stride_ksb, stride_ksh, stride_vsb, stride_vsh,
        heads, splits, scale,
        CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    ) -> None:  # fmt: skip
        """``_partials`` over an int8 ring read as int32 words (four bytes of one vector each),
        every byte made a float by ``_byte``. (Rounding the query to int8 too, for ``q . k``
        on the tensor cores, measured no faster and twice the error: docs/benchmarks.md.)"""
        row, split, b, h, start, end = _chunk(LENGTHS, heads, CHUNK)
        W: tl.constexpr = D // 4
        j = tl.arange(0, W)
        k_words = (K + b.to(tl.int64) * stride_kb + h * stride_kh).to(tl.pointer_type(tl.int32))
        v_words = (V + b.to(tl.int64) * stride_vb + h * stride_vh).to(tl.pointer_type(tl.int32))
        ks_base = K_SCALE + b.to(tl.int64) * stride_ksb + h * stride_ksh
        vs_base = V_SCALE + b.to(tl.int64) * stride_vsb + h * stride_vsh
        q0 = tl.load(Q + row * D + 4 * j).to(tl.float32) * scale  # byte i of word j is 4j + i
        q1 = tl.load(Q + row * D + 4 * j + 1).to(tl.float32) * scale
        q2 = tl.load(Q + row * D + 4 * j + 2).to(tl.float32) * scale
        q3 = tl.load(Q + row * D + 4 * j + 3).to(tl.float32) * scale
        m_i = tl.full([], float("-inf"), tl.float32)
        l_i = tl.full([], 0.0, tl.float32)
        acc0 = tl.zeros([W], dtype=tl.float32)
        acc1 = tl.zeros([W], dtype=tl.float32)
        acc2 = tl.zeros([W], dtype=tl.float32)
        acc3 = tl.zeros([W], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < end
            kw = tl.load(k_words + n[:, None] * (stride_kc // 4) + j[None, :], mask=valid[:, None], other=0)
            s = tl.sum(
                _byte(kw, 0) * q0[None, :] + _byte(kw, 1) * q1[None, :]
                + _byte(kw, 2) * q2[None, :] + _byte(kw, 3) * q3[None, :], axis=1,
            )  # fmt: skip
            s = s * tl.load(ks_base + n, mask=valid, other=0.0).to(tl.float32)
            m_new, alpha, p = _softmax_step(s, valid, m_i)
            pv = (p * tl.load(vs_base + n, mask=valid, other=0.0).to(tl.float32))[:, None]
            vw = tl.load(v_words + n[:, None] * (stride_vc // 4) + j[None, :], mask=valid[:, None], other=0)
            acc0 = acc0 * alpha + tl.sum(pv * _byte(vw, 0), axis=0)
            acc1 = acc1 * alpha + tl.sum(pv * _byte(vw, 1), axis=0)
            acc2 = acc2 * alpha + tl.sum(pv * _byte(vw, 2), axis=0)
            acc3 = acc3 * alpha + tl.sum(pv * _byte(vw, 3), axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        part = row * splits + split
        out = PART_OUT + part * D + 4 * j
        tl.store(out, acc0)
        tl.store(out + 1, acc1)
        tl.store(out + 2, acc2)
        tl.store(out + 3, acc3)
        tl.store(PART_MAX + part, m_i)
        tl.store(PART_SUM + part, l_i)

    @triton.jit
    def _quantize_write(
        K, V, RING, SCALES, SLOT, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_r0, stride_rb, stride_rh, stride_rc, stride_s0, stride_sb, stride_sh, stride_sc,
        heads, D: tl.constexpr,
    ) -> None:  # fmt: skip
        """One vector (key or value) of one (row, head): its scale, its bytes, both stored."""
        row = tl.program_id(0)
        which = tl.program_id(1)
        b = row // heads
        h = row % heads
        d = tl.arange(0, D)
        if which == 0:
            x = tl.load(K + b * stride_kb + h * stride_kh + d).to(tl.float32)
        else:
            x = tl.load(V + b * stride_vb + h * stride_vh + d).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-8) / 127.0
        y = x / scale
        q8 = tl.minimum(tl.maximum(tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5)), -127.0), 127.0)
        slot = tl.load(SLOT + b)
        ring = RING + which * stride_r0 + b.to(tl.int64) * stride_rb + h * stride_rh + slot * stride_rc
        tl.store(ring + d, q8.to(tl.int8))
        at = SCALES + which * stride_s0 + b.to(tl.int64) * stride_sb + h * stride_sh + slot * stride_sc
        tl.store(at, scale.to(SCALES.dtype.element_ty))

    @triton.jit
    def _merge(PART_OUT, PART_MAX, PART_SUM, OUT, splits, SPLITS: tl.constexpr, D: tl.constexpr) -> None:
        """Merge one (row, head)'s chunks; a row with no live slot gets zeros."""
        row = tl.program_id(0)
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, D)
        used = s < splits
        m = tl.load(PART_MAX + row * splits + s, mask=used, other=float("-inf"))
        l_s = tl.load(PART_SUM + row * splits + s, mask=used, other=0.0)
        o = tl.load(PART_OUT + (row * splits + s)[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
        m_all = tl.max(m, axis=0)
        m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))
        total = tl.sum(w * l_s, axis=0)
        num = tl.sum(w[:, None] * o, axis=0)
        out = num / tl.where(total > 0.0, total, 1.0)
        tl.store(OUT + row * D + d, out.to(OUT.dtype.element_ty))
