"""moshi's float32 RMSNorm (``rms_norm_f32``, every released LM's norm) as one kernel on CUDA.

The library computes it op by op: the input made float32, squared, averaged, ``eps``
added, ``rsqrt``, times ``alpha``, times the input, back to the input's type: eight
kernels a norm. A step of Hibiki-Zero runs 57 norms in the temporal transformer and 192
in the depformer (16 codebook steps of 6 layers, two each), so about 2,000 of a step's
kernels are norms, each a launch of its own inside the step's CUDA graphs, one after another.
``rms_norm`` does the same arithmetic in one program a row: the same order of products
(``x * (alpha * rsqrt(var))``), the mean of the squares summed in another order (float32,
so the result moves by a float32 rounding at most before it is rounded to the input's type).
Anywhere else (the CPU, no Triton, another norm type) the library's code runs unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from moshi.modules.transformer import RMSNorm

from .live_attention import triton, triton_available

if triton is not None:
    import triton.language as tl


class FusedRMSNorm(RMSNorm):
    """moshi's float32 ``RMSNorm`` (``rms_norm_f32``) as one kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and x.stride(-1) == 1:
            return rms_norm(x, self.alpha, self.eps)
        return super().forward(x)


def rms_norm(x: torch.Tensor, alpha: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * (alpha * rsqrt(eps + mean(x**2)))`` over the last dimension, in float32, returned in
    ``x``'s type: moshi's ``_rms_norm`` with ``dtype=float32``. ``x`` is ``[B, T, D]`` with ``D``
    contiguous (any batch and time strides), ``alpha`` ``D`` float32 values."""
    b, t, d = x.shape
    out = torch.empty((b, t, d), device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out
    block = triton.next_power_of_2(d)
    _rms_norm[(b * t,)](
        x, alpha, out, x.stride(0), x.stride(1), t, d, eps,
        BLOCK=block, num_warps=max(1, min(16, block // 256)),
    )  # fmt: skip
    return out


def install_fused_norms(module: Any, use_kernel: bool | None = None) -> int:
    """Make every moshi float32 ``RMSNorm`` in ``module`` a ``FusedRMSNorm``; how many. ``use_kernel``
    defaults to where Triton runs (CUDA); without it nothing changes (0)."""
    if use_kernel is None:
        use_kernel = triton_available(next(module.parameters()).device)
    if not use_kernel:
        return 0
    norms = [m for m in module.modules() if type(m) is RMSNorm and m.dtype == torch.float32]
    for norm in norms:
        norm.__class__ = FusedRMSNorm
    return len(norms)


if triton is not None:

    @triton.jit
    def _rms_norm(
        X, ALPHA, OUT, stride_b, stride_t, t, d, eps, BLOCK: tl.constexpr
    ) -> None:  # fmt: skip
        """One row (one time step of one batch row): its mean square, then each value."""
        row = tl.program_id(0)
        at = (row // t).to(tl.int64) * stride_b + (row % t) * stride_t
        i = tl.arange(0, BLOCK)
        keep = i < d
        x = tl.load(X + at + i, mask=keep, other=0.0).to(tl.float32)
        var = eps + tl.sum(x * x, axis=0) / d
        y = x * (tl.load(ALPHA + i, mask=keep, other=0.0) * tl.math.rsqrt(var))
        tl.store(OUT + row.to(tl.int64) * d + i, y.to(OUT.dtype.element_ty), mask=keep)
