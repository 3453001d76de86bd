"""moshi's RoPE and its SiLU gate as one kernel each on CUDA, so that a step without
torch.compile runs as few kernels as the compiled one.

moshi compiles three small functions with ``torch.compile``: the RMSNorm (``fused_norm.py``
replaces it), the RoPE (``apply_rope``) and the gated feed-forward's ``silu(a) * b``
(``gating_forward_kernel``). Compiled, each is one fused kernel, but dynamo traces them in
every engine process, again for each new batch shape: 7-19 s of an engine's start on an H100
(docs/moshi-engine.md, "Start-up and restart"). Eager, the RoPE is a dozen kernels a layer
(arange, exp, cos, sin, eight products, a stack) and the gate two, so a step is slower
(Hibiki-Zero 3B int8 at 336 rows on an H100: 29.8 ms against 27.0). With these two kernels
it is not: 30.8 ms p50 at 512 rows on an H200 against 31.7 compiled.

``FusedRotary`` does moshi's RoPE in one program a (row, time step, head) for the queries and
the keys together, in float32 as moshi does (``offset + t``, its product with the frequencies,
cos and sin, the rotation), rounded once to the input's type. The angle is brought into
``[-pi, pi]`` before its cos and sin (libdevice's, exact to a float32 rounding), which then
take their short path whatever the position: offsets grow for a whole session. ``FusedGating``
keeps moshi's two matmuls and does ``silu(a) * b`` in one program a row, in float32 rounded
once, as the compiled kernel does. Anywhere else (the CPU, no Triton, another activation,
quantized linears, heads before time) the library's code runs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from moshi.modules.gating import ActivationGating
from moshi.modules.rope import RotaryEmbedding
from torch.nn import functional as F

from .live_attention import triton, triton_available

if triton is not None:
    import triton.language as tl


class FusedRotary(RotaryEmbedding):
    """moshi's ``RotaryEmbedding``, heads before time (``[B, H, T, D]``), as one kernel."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, offset: torch.Tensor, time_before_heads: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if time_before_heads or q.dim() != 4 or offset.numel() != q.shape[0]:
            return super().forward(q, k, offset, time_before_heads)
        return rope(q, k, offset, self._frequencies(q.shape[-1], q.device), self.interleave)

    def _frequencies(self, d: int, device: torch.device) -> torch.Tensor:
        """moshi's ``freqs``, made by torch as moshi makes them (the kernel's ``exp`` would differ
        by a float32 rounding, which a position of thousands makes a visible angle): once."""
        cached = getattr(self, "_freqs", None)
        if cached is None or cached.shape[0] != d // 2 or cached.device != device:
            cached = self._freqs = frequencies(d, self.max_period, device)
        return cached


class FusedGating(ActivationGating):
    """moshi's SiLU-gated feed-forward with ``silu(a) * b`` as one kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_mul(F.linear(x, self.linear_in.weight)), self.linear_out.weight)


def frequencies(d: int, max_period: float, device: torch.device) -> torch.Tensor:
    """moshi's RoPE frequencies for heads of ``d`` values: ``d / 2`` float32."""
    ds = torch.arange(d // 2, device=device, dtype=torch.float32)
    return torch.exp(ds * (-math.log(max_period) * 2 / d))


def rope(
    q: torch.Tensor, k: torch.Tensor, offset: torch.Tensor, freqs: torch.Tensor, interleave: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """moshi's ``apply_rope`` with ``time_before_heads=False``: ``q`` ``[B, H, T, D]`` and ``k``
    ``[B, KV, T, D]`` (any strides), row ``b`` at positions ``offset[b] + t``, ``freqs`` of
    ``frequencies``; both rotated, new contiguous tensors as moshi returns them."""
    b, h, t, d = q.shape
    kv = k.shape[1]
    assert k.shape[0] == b and k.shape[2:] == q.shape[2:] and d % 2 == 0
    qo = torch.empty((b, h, t, d), device=q.device, dtype=q.dtype)
    ko = torch.empty((b, kv, t, d), device=k.device, dtype=k.dtype)
    if qo.numel() == 0:
        return qo, ko
    half = d // 2
    _rope[(b * t, h + kv)](
        q, k, qo, ko, offset.reshape(-1), freqs, *q.stride(), *k.stride(), t, h,
        INTERLEAVE=interleave, HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1,
    )  # fmt: skip
    return qo, ko


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :H]) * x[..., H:]`` of ``x`` ``[..., 2H]`` (the last dimension contiguous), in
    float32 rounded once to ``x``'s type: ``[..., H]``."""
    assert x.stride(-1) == 1 and x.shape[-1] % 2 == 0
    hidden = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * hidden)  # a view for a projection's output
    out = torch.empty((rows.shape[0], hidden), device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out.view(*x.shape[:-1], hidden)
    block = min(1024, triton.next_power_of_2(hidden))
    _silu_mul[(rows.shape[0], triton.cdiv(hidden, block))](
        rows, out, rows.stride(0), hidden, BLOCK=block, num_warps=4
    )
    return out.view(*x.shape[:-1], hidden)


def install_fused_pointwise(module: Any, use_kernel: bool | None = None) -> tuple[int, int]:
    """Make every moshi ``RotaryEmbedding`` in ``module`` a ``FusedRotary`` and every SiLU
    ``ActivationGating`` of plain linears a ``FusedGating``: how many of each. ``use_kernel``
    defaults to where Triton runs (CUDA); without it nothing changes."""
    if use_kernel is None:
        use_kernel = triton_available(next(module.parameters()).device)
    if not use_kernel:
        return 0, 0
    ropes = [m for m in module.modules() if type(m) is RotaryEmbedding]
    gates = [
        m for m in module.modules()
        if type(m) is ActivationGating and m.activation is F.silu
        and type(m.linear_in) is torch.nn.Linear and type(m.linear_out) is torch.nn.Linear
    ]  # fmt: skip
    for m in ropes:
        m.__class__ = FusedRotary
    for m in gates:
        m.__class__ = FusedGating
    return len(ropes), len(gates)


if triton is not None:

    @triton.jit
    def _rotate(
        X, OUT, FREQS, row_at, out_at, stride_d, pos,
        INTERLEAVE: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
    ) -> None:  # fmt: skip
        """One head's ``D`` values of one time step rotated, as moshi's ``apply_rope``."""
        i = tl.arange(0, BLOCK)
        keep = i < HALF
        angle = tl.load(FREQS + i, mask=keep, other=0.0) * pos
        # angle - 2 pi n, with 2 pi split in two (6.28125 takes n's bits exactly)
        n = tl.floor(angle * 0.15915494309189535 + 0.5)
        angle = (angle - n * 6.28125) - n * 0.0019353071795864769
        cos, sin = tl.cos(angle), tl.sin(angle)
        if INTERLEAVE:  # [r0, i0, r1, i1, ...]
            real_at, imag_at = 2 * i, 2 * i + 1
        else:  # [r..., i...]
            real_at, imag_at = i, i + HALF
        real = tl.load(X + row_at + real_at * stride_d, mask=keep, other=0.0).to(tl.float32)
        imag = tl.load(X + row_at + imag_at * stride_d, mask=keep, other=0.0).to(tl.float32)
        out_type = OUT.dtype.element_ty
        tl.store(OUT + out_at + real_at, (real * cos - imag * sin).to(out_type), mask=keep)
        tl.store(OUT + out_at + imag_at, (real * sin + imag * cos).to(out_type), mask=keep)

    @triton.jit
    def _rope(
        Q, K, QO, KO, OFFSET, FREQS, sqb, sqh, sqt, sqd, skb, skh, skt, skd, t, heads,
        INTERLEAVE: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
    ) -> None:  # fmt: skip
        """Program (row ``b * t + s``, head): heads ``[0, H)`` are the queries', the rest the keys'."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        b, s = (row // t).to(tl.int64), row % t
        pos = tl.load(OFFSET + b).to(tl.float32) + s.to(tl.float32)
        if head < heads:
            at = b * sqb + head * sqh + s * sqt
            out_at = ((b * heads + head) * t + s) * (2 * HALF)
            _rotate(Q, QO, FREQS, at, out_at, sqd, pos, INTERLEAVE, HALF, BLOCK)
        else:
            kv, kv_heads = head - heads, tl.num_programs(1) - heads
            at = b * skb + kv * skh + s * skt
            out_at = ((b * kv_heads + kv) * t + s) * (2 * HALF)
            _rotate(K, KO, FREQS, at, out_at, skd, pos, INTERLEAVE, HALF, BLOCK)

    @triton.jit
    def _silu_mul(X, OUT, stride_row, hidden, BLOCK: tl.constexpr) -> None:
        """Program (row, block of the hidden width): ``silu(a) * b`` in float32, rounded once."""
        row = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = i < hidden
        a = tl.load(X + row * stride_row + i, mask=keep, other=0.0).to(tl.float32)
        g = tl.load(X + row * stride_row + hidden + i, mask=keep, other=0.0).to(tl.float32)
        y = a / (1.0 + tl.exp(-a)) * g
        tl.store(OUT + row * hidden + i, y.to(OUT.dtype.element_ty), mask=keep)
