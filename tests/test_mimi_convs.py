"""Mimi's SEANet convolutions with their bias, ELU, kept samples and residual sums fused
(``moshi/mimi_convs.py``), run by Triton's interpreter on the CPU: each kernel against the
torch operations it replaces, then a streaming Mimi (idle rows, resets) against stock moshi."""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

CHECKS = textwrap.dedent(
    """
    import torch
    from moshi.models import loaders
    from duplexserve.engine_bridge.moshi import mimi_convs
    from duplexserve.engine_bridge.moshi.mimi_convs import (
        assemble, convtr_output, install_fused_convs, residual,
    )
    from duplexserve.engine_bridge.moshi.presets import TINY_MIMI

    torch.manual_seed(0)
    mimi_convs.BLOCK = 16  # rows of several blocks, a block across the kept samples' end
    def laid_out(got, cl):  # contiguous, or channels last ([B, T, C] in memory)
        return (got.transpose(1, 2) if cl else got).is_contiguous()

    for dtype, cl in ((torch.float32, False), (torch.float64, False), (torch.float32, True)):
        big = torch.randn(3, 40, 5, dtype=dtype)
        strided = [big[:, :, 1].reshape(3, 5, 8), big.permute(0, 2, 1)[:, :4]]
        cases = [torch.randn(2, 3, 37, dtype=dtype), *strided]
        for t in cases:
            b, c, n = t.shape
            bias = torch.randn(c, dtype=dtype)
            for kept in (0, 6, 20):
                previous = torch.randn(b, c, kept, dtype=dtype) if kept else None
                for with_bias in (False, True):
                    for elu in (False, True):
                        v = t + bias[:, None] if with_bias else t
                        if elu:
                            v = torch.nn.functional.elu(v)
                        want = v if previous is None else torch.cat([previous, v], -1)
                        got = assemble(t, bias if with_bias else None, previous, elu, cl)
                        assert laid_out(got, cl) and got.shape == want.shape
                        if elu:  # the interpreter's exp(x) - 1 for expm1: a few roundings of 1 off
                            eps = torch.finfo(dtype).eps
                            assert torch.allclose(got, want, rtol=4 * eps, atol=4 * eps), dtype
                        else:
                            assert torch.equal(got, want)
            x = torch.randn(b, c, n, dtype=dtype).transpose(1, 2).contiguous().transpose(1, 2)  # strided
            got = residual(x, t, bias, cl)
            assert laid_out(got, cl) and torch.equal(got, x + (t + bias[:, None]))
            assert torch.equal(residual(x, t, None, cl), x + t)
            for tail in (1, 4):
                partial = torch.randn(b, c, tail, dtype=dtype)
                want = (t + bias[:, None]).clone()
                want[..., :tail] += partial
                got = convtr_output(t, bias, partial, cl)
                assert laid_out(got, cl) and torch.equal(got, want[..., : n - tail])
    print("kernels exact")

    # Mimi streaming, float64 and float32, the convolutions' inputs contiguous or channels last:
    # the latent, the codes and the decoded audio, rows idle or reset at random, against stock
    # moshi on the same weights. (On the CPU a channels-last convolution sums in another order.)
    mimi_convs.BLOCK = 1024
    builds = ((torch.float64, 1e-12, False), (torch.float32, 1e-5, False), (torch.float64, 1e-12, True))
    for dtype, tolerance, cl in builds:
        stock = loaders.get_mimi(None, TINY_MIMI, device="cpu", num_codebooks=4).to(dtype)
        fused = loaders.get_mimi(None, TINY_MIMI, device="cpu", num_codebooks=4).to(dtype)
        fused.load_state_dict(stock.state_dict())
        assert install_fused_convs(fused, channels_last=cl)
        assert type(fused.encoder) is mimi_convs.FusedSEANetEncoder
        assert type(fused.decoder) is mimi_convs.FusedSEANetDecoder
        batch = 3
        rng = torch.Generator().manual_seed(1)
        schedule = [
            (torch.randn(batch, 1, 1920, generator=rng).to(dtype) * 0.1,
             torch.randint(0, 64, (batch, 4, 1), generator=rng),
             torch.rand(batch, generator=rng) < 0.7, torch.rand(batch, generator=rng) < 0.2)
            for _ in range(6)
        ]
        results = []
        for mimi in (stock, fused):
            latents, codes, audio = [], [], []
            with torch.no_grad(), mimi.streaming(batch):
                for pcm, given, active, reset in schedule:
                    mimi.reset_streaming(reset)
                    mimi.set_exec_mask(active)
                    latent = mimi._encode_to_unquantized_latent(pcm)  # mimi.encode's two halves
                    latents.append(latent[active])
                    codes.append(mimi.quantizer.encode(latent)[active])
                    audio.append(mimi.decode(given)[active])
            results.append([torch.cat(x) for x in (latents, codes, audio)])
        (latent, code, pcm), (f_latent, f_code, f_pcm) = results
        assert torch.equal(code, f_code)
        for a, b, what in ((latent, f_latent, "latent"), (pcm, f_pcm, "audio")):
            err = ((a - b).abs().max() / a.abs().max()).item()
            assert 0 <= err < tolerance, (dtype, what, err)
            print("mimi", dtype, "channels last" if cl else "", what, "max error", err)
        # outside streaming (the codec's batch encode), the library's forward
        pcm = torch.randn(2, 1, 3840, generator=rng).to(dtype)
        with torch.no_grad():
            assert torch.allclose(stock.encode(pcm), fused.encode(pcm))
    """
)


@pytest.mark.timeout(600)
def test_fused_mimi_convs_match_stock() -> None:
    pytest.importorskip("moshi")
    pytest.importorskip("triton")
    out = run_interpreted(CHECKS, timeout=540)
    assert "kernels exact" in out
    assert out.count("mimi") >= 6
