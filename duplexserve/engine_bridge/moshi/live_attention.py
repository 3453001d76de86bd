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
(``_partials_int8``; ``_partials_int8_mma`` takes ``q . k`` and ``p . v`` to the tensor
cores), and written by one kernel a layer (``write_quantized``); a bf16 ring's products go to
the tensor cores too (``_partials_mma``, ``KernelConfig.read == "mma"``, the default). Anywhere
else (the CPU, no Triton) the same prefix goes to ``scaled_dot_product_attention`` as a
boolean mask of moshi's own shape, which gives moshi's results bit for bit.

Grouped KV heads (``kv_repeat`` query heads share one KV head: Hibiki-Zero's 16 heads over
8) stay grouped in the ring, as in moshi's own, and are never repeated: a program of the
kernel takes one KV head and its ``kv_repeat`` query heads, so each tile of the ring is
loaded once for all of them, and SDPA gets ``enable_gqa`` (torch >= 2.5), which on the
CPU reads the heads in place and gives the repeated ring's results bit for bit. Stock
moshi instead copies the whole ring ``kv_repeat`` times in every layer of every step.
"""

from __future__ import annotations

import dataclasses
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
    and how it reads the ring and takes its products (``read``)."""

    chunk: int = 256  # keys per program: at capacity 3000 a row is at most 12 programs
    block_n: int = 32  # keys loaded per iteration of a program
    warps: int = 2
    stages: int = 3
    # "cast": products as float32 broadcasts (an int8 ring: a conversion a byte); "bits": an int8
    # ring's bytes made floats by ``_byte`` (a bf16 ring: as "cast"); "mma": the tensor cores (bf16:
    # ``_partials_mma``; int8: ``_byte`` and ``_partials_int8_mma``)
    read: str = "cast"

    def __post_init__(self) -> None:
        if self.read not in ("cast", "bits", "mma"):
            raise ValueError(f"ring read {self.read!r}: cast, bits or mma")

    @classmethod
    def parse(cls, text: str) -> KernelConfig:
        """``chunk/block/warps/stages[/read]``, as the benchmarks name a configuration."""
        fields = text.split("/")
        return cls(*(int(x) for x in fields[:4]), *fields[4:])  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"{self.chunk}/{self.block_n}/{self.warps}/{self.stages}/{self.read}"


# H200, bf16 ring of 352 rows, 2 query heads a KV head (Hibiki-Zero's): all 3000 slots live 0.99 ms
# a layer against 2.18 ms ("cast") and a 0.98 ms floor; a quarter live 0.28 against 0.59 and 0.25.
# A float32 ring (the CPU tests) reads as "cast": the tensor cores take 16-bit operands here.
DEFAULT = KernelConfig(chunk=512, block_n=16, warps=1, read="mma")
# H200, int8 ring of 512 rows, 2 query heads a KV head, all 3000 slots live: 1.13 ms a layer
# against 2.30 ms ("bits", the best of 13 tiles before; "cast" slower still) and a 0.73 ms floor.
DEFAULT_INT8 = KernelConfig(chunk=512, block_n=16, warps=1, read="mma")


def prefix_mask(lengths: torch.Tensor, capacity: int) -> torch.Tensor:
    """The boolean mask ``[B, 1, 1, capacity]`` that keeps each row's first ``length`` slots."""
    slots = torch.arange(capacity, device=lengths.device)
    return (slots.view(1, -1) < lengths.view(-1, 1))[:, None, None]


def reference_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """The library's own attention call, with the prefix mask; ``keys`` and ``values`` may
    hold fewer heads than ``q`` (grouped, query head ``h`` reading KV head ``h // kv_repeat``)."""
    return F.scaled_dot_product_attention(
        q, keys, values, mask, dropout_p=0.0, enable_gqa=q.shape[1] != keys.shape[1]
    )


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per vector of the last dimension (a slot of one head),
    rounded half away from zero like ``write_quantized``."""
    scale = x.abs().amax(dim=-1).float().clamp(min=1e-8) / 127.0
    y = x.float() / scale[..., None]
    q8 = (y.sign() * (y.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)
    return q8, scale.to(x.dtype)


def write_quantized(
    k: torch.Tensor,
    v: torch.Tensor,
    ring: torch.Tensor,
    scales: torch.Tensor,
    slot: torch.Tensor,
    page: torch.Tensor | None = None,
) -> None:
    """``quantize`` this step's ``k`` and ``v`` (``[B, H, 1, D]``, ``H`` the KV heads) into slot
    ``slot[b]`` of each row of the int8 ring ``[2, B, H, C, D]`` and its scales ``[2, B, H, C]``, in one
    kernel where the torch form takes a dozen small ones a layer. With ``page`` the ring is a page
    pool ``[2, pages, H, PAGE, D]`` (paged_kv.py) and row ``b`` writes page ``page[b]``."""
    b, h, _, d = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    _quantize_write[(b * h, 2)](
        k, v, ring, scales, slot, slot if page is None else page,
        *k.stride()[:2], *v.stride()[:2], *ring.stride()[:4], *scales.stride(),
        h, D=d, PAGED=page is not None, num_warps=1,
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
    table: torch.Tensor | None = None,
    capacity: int = 0,
) -> torch.Tensor:
    """Attention of one query per row over the first ``lengths[b]`` slots of row ``b``.

    ``q`` is ``[B, H, 1, D]``; ``keys`` and ``values`` are ``[B, KV, C, D]`` views of the
    ring with ``D`` contiguous, ``KV`` dividing ``H`` (query head ``h`` reads KV head
    ``h // (H / KV)``, moshi's grouping); ``lengths`` is ``[B]`` int32. A row of length 0
    gets zeros. With ``scales`` (key and value scales, ``[B, KV, C]`` each) the ring holds
    int8 and slot ``c`` of KV head ``g`` stands for ``ring * scale``, dequantized as it is read.

    Paged (``table``, paged_kv.py): ``keys`` and ``values`` are page pools ``[pages, KV, PAGE, D]``
    (scales ``[pages, KV, PAGE]``), slots ``[i * PAGE, (i + 1) * PAGE)`` of row ``b`` are page
    ``table[b, i]``, and a row holds up to ``capacity`` slots: each program reads one page (the
    chunk is the page), the kernels' only difference being where that chunk starts.
    """
    b, h, t, d = q.shape
    kv_heads = keys.shape[1]
    group = h // kv_heads
    assert t == 1 and group * kv_heads == h and keys.stride(-1) == 1 and values.stride(-1) == 1
    config = config or (DEFAULT if scales is None else DEFAULT_INT8)
    if table is None:
        capacity, table = keys.shape[2], lengths  # the table unread
    else:
        config = dataclasses.replace(config, chunk=keys.shape[2])
        assert table.dtype == torch.int32 and table.stride(1) == 1
        assert table.shape[1] * config.chunk >= capacity
    paged = table is not lengths
    splits = triton.cdiv(capacity, config.chunk)
    q2 = q.reshape(b * h, d) if q.is_contiguous() else q.contiguous().reshape(b * h, d)
    part_out = torch.empty((b * h, splits, d), device=q.device, dtype=torch.float32)
    part_max = torch.empty((b * h, splits), device=q.device, dtype=torch.float32)
    part_sum = torch.empty((b * h, splits), device=q.device, dtype=torch.float32)
    ring_strides = (*keys.stride()[:3], *values.stride()[:3])
    k_scale, v_scale = scales if scales is not None else (lengths, lengths)  # unread without scales
    scale_strides = (*k_scale.stride()[:2], *v_scale.stride()[:2]) if scales is not None else (0, 0, 0, 0)
    args = (q2, keys, values, k_scale, v_scale, lengths, part_out, part_max, part_sum, table, table.stride(0),
            *ring_strides, *scale_strides, kv_heads, group, splits, 1.0 / math.sqrt(d))  # fmt: skip
    tiles = {"CHUNK": config.chunk, "BLOCK_N": config.block_n, "D": d, "GROUP": triton.next_power_of_2(group),
             "PAGED": paged, "num_warps": config.warps, "num_stages": config.stages}  # fmt: skip
    dots = config.read == "mma" and d >= 64 and config.block_n >= 16  # tl.dot's smallest operands
    dot_tiles = {**tiles, "GROUP": max(16, tiles["GROUP"])}  # the query block padded to tl.dot's 16 rows
    if scales is None and dots and keys.element_size() == 2:  # a bf16 (or float16) ring
        _partials_mma[(b * kv_heads, splits)](*args, **dot_tiles)
    elif scales is None or config.read == "cast":
        _partials[(b * kv_heads, splits)](*args, QUANT=scales is not None, **tiles)
    else:  # whole int32 words of the int8 ring: every offset a multiple of 4 bytes
        assert all(x % 4 == 0 for x in (d, *ring_strides, keys.data_ptr(), values.data_ptr()))
        if dots:
            _partials_int8_mma[(b * kv_heads, splits)](*args, **dot_tiles)
        else:  # "bits", or heads too narrow for the tensor cores
            _partials_int8[(b * kv_heads, splits)](*args, **tiles)
    out = torch.empty((b * h, d), device=q.device, dtype=q.dtype)
    _merge[(b * h,)](
        part_out, part_max, part_sum, lengths, out, h, splits,
        SPLITS=triton.next_power_of_2(splits), CHUNK=config.chunk, D=d, num_warps=4,
    )  # fmt: skip
    return out.view(b, h, 1, d)


if triton is not None:
    # The int8 tensor-core kernel's lazy rescale: its weights are taken against a running maximum
    # that lags the true one by at most this (e**8 = 2981 < float16's 65504).
    RESCALE_NATS = tl.constexpr(8.0)

    @triton.jit
    def _chunk(  # type: ignore[no-untyped-def]
        LENGTHS, TABLE, stride_tb, kv_heads, group,
        CHUNK: tl.constexpr, GROUP: tl.constexpr, PAGED: tl.constexpr,
    ):  # fmt: skip
        """This program's row ``b``, KV head ``g``, chunk ``[start, end)`` of the row's live
        prefix, and the rows of ``Q`` (``[B * H, D]``) of the group's query heads (``used``:
        the ``group`` real ones of ``GROUP``, its power of two); where the chunk's slots are:
        ``page`` (the ring's row ``b``, or, ``PAGED``, the page the block table ``TABLE`` gives
        chunk ``split`` of row ``b``: a page holds one chunk) and ``shift``, the slot the page
        starts at (0 in a ring), so that slot ``n`` lies at offset ``n - shift`` of ``page``."""
        program = tl.program_id(0)  # b * kv_heads + g
        split = tl.program_id(1)
        b = program // kv_heads
        start = split * CHUNK
        end = tl.minimum(start + CHUNK, tl.load(LENGTHS + b))
        r = tl.arange(0, GROUP)
        if PAGED:
            page = tl.load(TABLE + b.to(tl.int64) * stride_tb + split, mask=start < end, other=0).to(tl.int64)
            shift = start
        else:
            page = b.to(tl.int64)
            shift = 0
        return program * group + r, r < group, split, b, program % kv_heads, start, end, page, shift

    @triton.jit
    def _softmax_step(s, valid, m_i):  # type: ignore[no-untyped-def]
        """One tile of each query's running softmax (``s``: ``[GROUP, BLOCK_N]``): the new
        maximum, the rescale of what came before, and the tile's unnormalised weights (0
        for keys past the chunk)."""
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        return m_new, tl.exp(m_i - m_new), tl.exp(s - m_new[:, None])

    @triton.jit
    def _start(  # type: ignore[no-untyped-def]
        K, V, page, shift, g, stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc,
        D: tl.constexpr, GROUP: tl.constexpr,
    ):  # fmt: skip
        """The ring kernels' common start: the (row or page, KV head)'s keys and values, where
        slot ``n`` is at ``base + n * stride`` (``_chunk``'s ``shift`` taken off), and each
        query's running softmax and value sum at their start."""
        k_base = K + page * stride_kb + g * stride_kh - shift * stride_kc
        v_base = V + page * stride_vb + g * stride_vh - shift * stride_vc
        m_i = tl.full([GROUP], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP], dtype=tl.float32)
        return k_base, v_base, m_i, l_i, tl.zeros([GROUP, D], dtype=tl.float32)

    @triton.jit
    def _store(PART_OUT, PART_MAX, PART_SUM, part, used, d, D: tl.constexpr, acc, m_i, l_i):  # type: ignore[no-untyped-def]
        """A chunk's partials for the merge: each query's weighted value sum, max and sum."""
        tl.store(PART_OUT + part[:, None] * D + d[None, :], acc, mask=used[:, None])
        tl.store(PART_MAX + part, m_i, mask=used)
        tl.store(PART_SUM + part, l_i, mask=used)

    @triton.jit
    def _partials(
        Q, K, V, K_SCALE, V_SCALE, LENGTHS, PART_OUT, PART_MAX, PART_SUM, TABLE, stride_tb,
        stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc,
        stride_ksb, stride_ksh, stride_vsb, stride_vsh,
        kv_heads, group, splits, scale,
        QUANT: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
        PAGED: tl.constexpr,
    ) -> None:  # fmt: skip
        """One chunk of one (row, KV head) for each of its query heads: softmax max, sum and
        weighted value sum, every K/V tile loaded once for the group."""
        rows, used, split, _, g, start, end, page, shift = _chunk(
            LENGTHS, TABLE, stride_tb, kv_heads, group, CHUNK, GROUP, PAGED
        )
        d = tl.arange(0, D)
        q = tl.load(Q + rows[:, None] * D + d[None, :], mask=used[:, None], other=0.0).to(tl.float32) * scale
        k_base, v_base, m_i, l_i, acc = _start(
            K, V, page, shift, g, stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc, D, GROUP
        )  # fmt: skip
        ks_base = K_SCALE + page * stride_ksb + g * stride_ksh - shift  # slots contiguous
        vs_base = V_SCALE + page * stride_vsb + g * stride_vsh - shift
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < end
            k = tl.load(k_base + n[:, None] * stride_kc + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.sum(k.to(tl.float32)[None, :, :] * q[:, None, :], axis=2)
            if QUANT:
                s = s * tl.load(ks_base + n, mask=valid, other=0.0).to(tl.float32)[None, :]
            m_new, alpha, p = _softmax_step(s, valid, m_i)
            v = tl.load(v_base + n[:, None] * stride_vc + d[None, :], mask=valid[:, None], other=0.0)
            pv = p
            if QUANT:
                pv = p * tl.load(vs_base + n, mask=valid, other=0.0).to(tl.float32)[None, :]
            acc = acc * alpha[:, None] + tl.sum(pv[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        _store(PART_OUT, PART_MAX, PART_SUM, rows * splits + split, used, d, D, acc, m_i, l_i)

    @triton.jit
    def _partials_mma(
        Q, K, V, K_SCALE, V_SCALE, LENGTHS, PART_OUT, PART_MAX, PART_SUM, TABLE, stride_tb,
        stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc,
        stride_ksb, stride_ksh, stride_vsb, stride_vsh,
        kv_heads, group, splits, scale,
        CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, PAGED: tl.constexpr,
    ) -> None:  # fmt: skip
        """``_partials`` of a 16-bit ring with ``q . k`` and ``p . v`` on the tensor cores (``GROUP``:
        the query block, padded to tl.dot's 16 rows), as flash attention takes them: the ring's
        own values, float32 sums, the weights rounded to the ring's type for ``p . v``. The
        broadcast form multiplies ``group`` queries by every loaded key on the CUDA cores in
        float32 ([GROUP, BLOCK_N, D] products reduced across threads); on the H200 it read a
        bf16 ring at 2.2-4.3x its floor with two queries a KV head, this form at 1.0-1.15x."""
        rows, used, split, _, g, start, end, page, shift = _chunk(
            LENGTHS, TABLE, stride_tb, kv_heads, group, CHUNK, GROUP, PAGED
        )
        d = tl.arange(0, D)
        q = tl.load(Q + rows[:, None] * D + d[None, :], mask=used[:, None], other=0.0)
        k_base, v_base, m_i, l_i, acc = _start(
            K, V, page, shift, g, stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc, D, GROUP
        )  # fmt: skip
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < end
            k = tl.load(k_base + n[:, None] * stride_kc + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            m_new, alpha, p = _softmax_step(s, valid, m_i)
            v = tl.load(v_base + n[:, None] * stride_vc + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        _store(PART_OUT, PART_MAX, PART_SUM, rows * splits + split, used, d, D, acc, m_i, l_i)

    @triton.jit
    def _byte(w, i: tl.constexpr):  # type: ignore[no-untyped-def]
        """Byte ``i`` of each int32 word, an int8 ``x``, as float32, exactly: ``x + 128`` goes
        into the mantissa of 2**23 and one add takes the bias off. Integer-to-float
        conversions run at a fraction of an add's rate, and an int8 ring needs one a byte."""
        return (((w >> (8 * i)) & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0

    @triton.jit
    def _half(w, i: tl.constexpr):  # type: ignore[no-untyped-def]
        """Byte ``i`` of each int32 word, an int8 ``x``, as float16, exactly and without a
        conversion instruction: ``x + 128`` goes into the mantissa of 1024.0 (bits 0x6400) and a
        float16 subtraction, two a lane (HADD2), takes the 1152 off. ``_byte(w, i).to(tl.float16)``
        took a float32 add and a float32-to-float16 conversion a byte: compiled for sm_90 at
        512/16/1/3, 148 FADD and 68 F2FP become 20 FADD and 64 HADD2 (2,576 instructions, 2,440)."""
        return (((w >> (8 * i)) & 0xFF) ^ 0x6480).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0

    @triton.jit
    def _start_words(  # type: ignore[no-untyped-def]
        Q, K, V, K_SCALE, V_SCALE, rows, page, shift, g, D: tl.constexpr, GROUP: tl.constexpr,
        stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc,
        stride_ksb, stride_ksh, stride_vsb, stride_vsh,
    ):  # fmt: skip
        """The int8 kernels' common start, so their reads and ``_store_words``'s layout agree:
        word indices ``j``, the (row, KV head)'s ring as int32 words and its scales, the query
        bytes' pointers (each kernel loads them in its own precision), and the running softmax
        and four accumulators at their start."""
        W: tl.constexpr = D // 4
        j = tl.arange(0, W)
        k_words = (K + page * stride_kb + g * stride_kh - shift * stride_kc).to(tl.pointer_type(tl.int32))
        v_words = (V + page * stride_vb + g * stride_vh - shift * stride_vc).to(tl.pointer_type(tl.int32))
        ks_base = K_SCALE + page * stride_ksb + g * stride_ksh - shift
        vs_base = V_SCALE + page * stride_vsb + g * stride_vsh - shift
        q_at = Q + rows[:, None] * D + 4 * j[None, :]  # byte i of word j is 4j + i
        m_i = tl.full([GROUP], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP], dtype=tl.float32)
        acc0 = tl.zeros([GROUP, W], dtype=tl.float32)
        acc1 = tl.zeros([GROUP, W], dtype=tl.float32)
        acc2 = tl.zeros([GROUP, W], dtype=tl.float32)
        acc3 = tl.zeros([GROUP, W], dtype=tl.float32)
        return j, k_words, v_words, ks_base, vs_base, q_at, m_i, l_i, acc0, acc1, acc2, acc3

    @triton.jit
    def _partials_int8(
        Q, K, V, K_SCALE, V_SCALE, LENGTHS, PART_OUT, PART_MAX, PART_SUM, TABLE, stride_tb,
        stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc,
        stride_ksb, stride_ksh, stride_vsb, stride_vsh,
        kv_heads, group, splits, scale,
        CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, PAGED: tl.constexpr,
    ) -> None:  # fmt: skip
        """``_partials`` over an int8 ring read as int32 words (four bytes of one vector each),
        every byte made a float by ``_byte`` once for the group. (Rounding the query to int8
        too, for ``q . k`` on the tensor cores, measured no faster and twice the error:
        docs/benchmarks.md.)"""
        rows, used, split, _, g, start, end, page, shift = _chunk(
            LENGTHS, TABLE, stride_tb, kv_heads, group, CHUNK, GROUP, PAGED
        )
        j, k_words, v_words, ks_base, vs_base, q_at, m_i, l_i, acc0, acc1, acc2, acc3 = _start_words(
            Q, K, V, K_SCALE, V_SCALE, rows, page, shift, g, D, GROUP,
            stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc,
            stride_ksb, stride_ksh, stride_vsb, stride_vsh,
        )  # fmt: skip
        q0 = tl.load(q_at, mask=used[:, None], other=0.0).to(tl.float32)[:, None, :] * scale
        q1 = tl.load(q_at + 1, mask=used[:, None], other=0.0).to(tl.float32)[:, None, :] * scale
        q2 = tl.load(q_at + 2, mask=used[:, None], other=0.0).to(tl.float32)[:, None, :] * scale
        q3 = tl.load(q_at + 3, mask=used[:, None], other=0.0).to(tl.float32)[:, None, :] * scale
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            valid = n < end
            kw = tl.load(k_words + n[:, None] * (stride_kc // 4) + j[None, :], mask=valid[:, None], other=0)
            s = tl.sum(
                _byte(kw, 0)[None, :, :] * q0 + _byte(kw, 1)[None, :, :] * q1
                + _byte(kw, 2)[None, :, :] * q2 + _byte(kw, 3)[None, :, :] * q3, axis=2,
            )  # fmt: skip
            s = s * tl.load(ks_base + n, mask=valid, other=0.0).to(tl.float32)[None, :]
            m_new, alpha, p = _softmax_step(s, valid, m_i)
            pv = (p * tl.load(vs_base + n, mask=valid, other=0.0).to(tl.float32)[None, :])[:, :, None]
            vw = tl.load(v_words + n[:, None] * (stride_vc // 4) + j[None, :], mask=valid[:, None], other=0)
            acc0 = acc0 * alpha[:, None] + tl.sum(pv * _byte(vw, 0)[None, :, :], axis=1)
            acc1 = acc1 * alpha[:, None] + tl.sum(pv * _byte(vw, 1)[None, :, :], axis=1)
            acc2 = acc2 * alpha[:, None] + tl.sum(pv * _byte(vw, 2)[None, :, :], axis=1)
            acc3 = acc3 * alpha[:, None] + tl.sum(pv * _byte(vw, 3)[None, :, :], axis=1)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        part = rows * splits + split
        _store_words(PART_OUT, PART_MAX, PART_SUM, part, used, j, D, acc0, acc1, acc2, acc3, m_i, l_i)

    @triton.jit
    def _store_words(  # type: ignore[no-untyped-def]
        PART_OUT, PART_MAX, PART_SUM, part, used, j, D: tl.constexpr, acc0, acc1, acc2, acc3, m_i, l_i
    ):
        """A chunk's partials, its output held as four accumulators: element ``4 j + i`` of the
        head in ``acc<i>[:, j]`` (the int8 kernels' layout)."""
        out = PART_OUT + part[:, None] * D + 4 * j[None, :]
        tl.store(out, acc0, mask=used[:, None])
        tl.store(out + 1, acc1, mask=used[:, None])
        tl.store(out + 2, acc2, mask=used[:, None])
        tl.store(out + 3, acc3, mask=used[:, None])
        tl.store(PART_MAX + part, m_i, mask=used)
        tl.store(PART_SUM + part, l_i, mask=used)

    @triton.jit
    def _partials_int8_mma(
        Q, K, V, K_SCALE, V_SCALE, LENGTHS, PART_OUT, PART_MAX, PART_SUM, TABLE, stride_tb,
        stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc,
        stride_ksb, stride_ksh, stride_vsb, stride_vsh,
        kv_heads, group, splits, scale,
        CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, PAGED: tl.constexpr,
    ) -> None:  # fmt: skip
        """``_partials_int8`` with ``q . k`` and ``p . v`` on the tensor cores (``GROUP``: the query
        block, padded to tl.dot's 16 rows). With the group's products on the CUDA cores, each
        byte cost a conversion and ``group`` multiply-adds, a reduction across threads and, in
        the 3-d broadcast, conversions repeated per query: at two queries a KV head the kernel
        ran at 3-4x its memory floor. Here a byte costs its ``_half`` (float16, exact: an int8 is),
        whatever the group, and the scales go to the scores and the weights, one
        multiply a key: ``s = (q . k8) * k_scale``, ``acc += (p * v_scale / v_top) . v8`` on the
        tensor cores' own accumulator, ``acc * v_top`` at the end, the weights taken over the
        chunk's largest value scale ``v_top`` so that float16 keeps their precision. The
        accumulators are the query block padded to 16 rows, eight times the group's two: rescaling
        them at every tile, as the running maximum moves, was a quarter of the loop's instructions
        (sm_90, 512/16/1/3: 802 a tile of 16 slots), so the maximum moves only when a score passes
        it by ``RESCALE_NATS`` and they are rescaled then alone (652).
        A chunk past the row's length loads the length and nothing else."""
        rows, used, split, _, g, start, end, page, shift = _chunk(
            LENGTHS, TABLE, stride_tb, kv_heads, group, CHUNK, GROUP, PAGED
        )
        if start < end:
            j, k_words, v_words, ks_base, vs_base, q_at, m_i, l_i, acc0, acc1, acc2, acc3 = _start_words(
                Q, K, V, K_SCALE, V_SCALE, rows, page, shift, g, D, GROUP,
                stride_kb, stride_kh, stride_kc, stride_vb, stride_vh, stride_vc,
                stride_ksb, stride_ksh, stride_vsb, stride_vsh,
            )  # fmt: skip
            k_slot, v_slot = stride_kc // 4, stride_vc // 4  # in words
            q0 = tl.load(q_at, mask=used[:, None], other=0.0).to(tl.float16)
            q1 = tl.load(q_at + 1, mask=used[:, None], other=0.0).to(tl.float16)
            q2 = tl.load(q_at + 2, mask=used[:, None], other=0.0).to(tl.float16)
            q3 = tl.load(q_at + 3, mask=used[:, None], other=0.0).to(tl.float16)
            cn = start + tl.arange(0, CHUNK)  # the chunk's largest value scale (> 0: at least 1e-8 / 127)
            v_top = tl.max(tl.load(vs_base + cn, mask=cn < end, other=0.0).to(tl.float32), axis=0)
            for n0 in range(start, end, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                valid = n < end
                kw = tl.load(k_words + n[:, None] * k_slot + j[None, :], mask=valid[:, None], other=0)
                s = tl.dot(q0, tl.trans(_half(kw, 0)))
                s = tl.dot(q1, tl.trans(_half(kw, 1)), s)
                s = tl.dot(q2, tl.trans(_half(kw, 2)), s)
                s = tl.dot(q3, tl.trans(_half(kw, 3)), s)
                s = s * (tl.load(ks_base + n, mask=valid, other=0.0).to(tl.float32) * scale)[None, :]
                s = tl.where(valid[None, :], s, float("-inf"))
                # the running maximum moves only when a score passes it by more than RESCALE_NATS:
                # weights stay at most e**8 (float16 holds them), and the accumulators are rescaled
                # in the few tiles where it moves, not in every one
                m_tile = tl.max(s, axis=1)
                m_new = tl.where(m_tile > m_i + RESCALE_NATS, m_tile, m_i)
                if tl.max((m_new > m_i).to(tl.int32), axis=0) > 0:
                    alpha = tl.exp(m_i - m_new)
                    acc0 = acc0 * alpha[:, None]
                    acc1 = acc1 * alpha[:, None]
                    acc2 = acc2 * alpha[:, None]
                    acc3 = acc3 * alpha[:, None]
                    l_i = l_i * alpha
                m_i = m_new
                p = tl.exp(s - m_i[:, None])
                vs = tl.load(vs_base + n, mask=valid, other=0.0).to(tl.float32)
                pv = (p * (vs * (1.0 / v_top))[None, :]).to(tl.float16)
                vw = tl.load(v_words + n[:, None] * v_slot + j[None, :], mask=valid[:, None], other=0)
                acc0 = tl.dot(pv, _half(vw, 0), acc0)
                acc1 = tl.dot(pv, _half(vw, 1), acc1)
                acc2 = tl.dot(pv, _half(vw, 2), acc2)
                acc3 = tl.dot(pv, _half(vw, 3), acc3)
                l_i += tl.sum(p, axis=1)
            part = rows * splits + split
            acc0, acc1, acc2, acc3 = acc0 * v_top, acc1 * v_top, acc2 * v_top, acc3 * v_top
            _store_words(PART_OUT, PART_MAX, PART_SUM, part, used, j, D, acc0, acc1, acc2, acc3, m_i, l_i)

    @triton.jit
    def _quantize_write(
        K, V, RING, SCALES, SLOT, PAGE, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_r0, stride_rb, stride_rh, stride_rc, stride_s0, stride_sb, stride_sh, stride_sc,
        heads, D: tl.constexpr, PAGED: tl.constexpr,
    ) -> None:  # fmt: skip
        """One vector (key or value) of one (row, KV head): its scale, its bytes, both stored
        at slot ``SLOT[b]`` of row ``b`` of the ring, or, ``PAGED``, of page ``PAGE[b]`` of the pool."""
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
        if PAGED:  # noqa: SIM108 (a constexpr branch)
            at_b = tl.load(PAGE + b).to(tl.int64)
        else:
            at_b = b.to(tl.int64)
        ring = RING + which * stride_r0 + at_b * stride_rb + h * stride_rh + slot * stride_rc
        tl.store(ring + d, q8.to(tl.int8))
        at = SCALES + which * stride_s0 + at_b * stride_sb + h * stride_sh + slot * stride_sc
        tl.store(at, scale.to(SCALES.dtype.element_ty))

    @triton.jit
    def _merge(
        PART_OUT, PART_MAX, PART_SUM, LENGTHS, OUT, heads, splits,
        SPLITS: tl.constexpr, CHUNK: tl.constexpr, D: tl.constexpr,
    ) -> None:  # fmt: skip
        """Merge one (row, head)'s live chunks (those past the row's length are neither read nor
        need be written); a row with no live slot gets zeros."""
        row = tl.program_id(0)  # b * heads + head
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, D)
        used = (s < splits) & (s * CHUNK < tl.load(LENGTHS + row // heads))
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
