"""The one-kernel RMSNorm (``moshi/fused_norm.py``), run by Triton's interpreter on the CPU:
against moshi's own ``_rms_norm`` alone, and inside the temporal transformer and the depformer."""

import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import torch
    from moshi.models import loaders
    from moshi.modules.transformer import RMSNorm, _rms_norm
    from duplexserve.engine_bridge.moshi.fused_norm import (
        FusedResidualLayer, FusedRMSNorm, add_rms_norm, install_fused_norms, rms_norm,
    )
    from duplexserve.engine_bridge.moshi.presets import get_preset

    torch.manual_seed(0)
    # [B, T, D]: one step, several steps, a width that is not a power of two, and views whose
    # batch and time strides are not the contiguous ones
    big = torch.randn(4, 6, 160)
    cases = [torch.randn(5, 1, 64), torch.randn(2, 3, 96) * 30, big[:, ::2, :96], big.transpose(0, 1)[:, :3]]
    for x in cases:
        alpha = torch.rand(1, 1, x.shape[-1]) + 0.5
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            got, ref = rms_norm(xd, alpha, 1e-8), _rms_norm(xd, alpha, torch.float32, 1e-8)
            assert got.dtype == dtype and got.shape == ref.shape
            if dtype == torch.float32:
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                assert err < 1e-6, err
            else:  # the float32 value made bf16: one bf16 step at most (the interpreter truncates
                # where the GPU rounds, so about half the values are one step apart here)
                diff = (got.float() - ref.float()).abs()
                assert (diff <= ref.float().abs() * 2**-7).all(), diff.max()
            print("rms_norm max error", dtype, tuple(x.shape))
            # the residual's sum and its norm in one kernel: the sum is torch's (float32: bit for
            # bit; bf16: within the interpreter's truncation), the norm rms_norm's of that sum
            update = (torch.randn(x.shape) * 3).to(dtype)
            h, normed = add_rms_norm(xd, update, alpha, 1e-8)
            want = xd + update
            assert h.dtype == dtype and normed.dtype == dtype
            if dtype == torch.float32:
                assert torch.equal(h, want), (h - want).abs().max()
            else:
                assert ((h.float() - want.float()).abs() <= want.float().abs() * 2**-7).all()
            assert torch.equal(normed, rms_norm(h, alpha, 1e-8))
            print("add_rms_norm exact", dtype, tuple(x.shape))

    # an LM with every norm fused (float32 weights: the whole transformer to float32 precision)
    kwargs = get_preset("tiny-zero").lm
    stock = loaders.get_moshi_lm(None, lm_kwargs=kwargs, device="cpu", dtype=torch.float32)
    fused = loaders.get_moshi_lm(None, lm_kwargs=kwargs, device="cpu", dtype=torch.float32)
    fused.load_state_dict(stock.state_dict())
    norms = sum(type(m) is RMSNorm for m in fused.modules())
    assert norms == 2 * len(fused.transformer.layers) + 1 + 2 * len(fused.depformer.layers), norms
    assert install_fused_norms(fused, use_kernel=True) == norms
    assert not any(type(m) is RMSNorm for m in fused.modules())
    assert sum(type(m) is FusedRMSNorm for m in fused.modules()) == norms
    for layers in (list(fused.transformer.layers), list(fused.depformer.layers)):
        assert all(type(m) is FusedResidualLayer and m._fuse_residual for m in layers)
        assert [m._next for m in layers] == [*layers[1:], None]  # each hands the next its input
    assert sum(1 for _ in fused.modules()) == sum(1 for _ in stock.modules())  # no module twice
    tokens = torch.randint(0, 64, (3, stock.num_codebooks, 1), generator=torch.Generator().manual_seed(1))
    outs = []
    for lm in (stock, fused):
        with torch.no_grad(), lm.streaming(3):
            steps = [lm.forward_text(tokens)[0] for _ in range(4)]
            with lm.depformer.streaming(3):  # two codebook steps over the last output
                logits = [lm.forward_depformer(k, tokens[:, k : k + 1], steps[-1]) for k in (0, 1)]
        outs.append((torch.stack(steps), torch.stack(logits)))
    for (a, b), what in zip(zip(*outs), ("transformer", "depformer logits")):
        err = ((a - b).abs().max() / a.abs().max()).item()
        assert 0 <= err < 1e-5, (what, err)
        print(what, "max error", err)
    """
)


@pytest.mark.timeout(300)
def test_the_fused_rms_norm_equals_moshis():
    """The kernel against moshi's ``_rms_norm`` (float32 exact to its rounding, bf16 within one
    step of its own), the residual's sum with it bit for bit torch's, and a tiny-zero LM with
    every norm and every layer's residual fused against the stock one."""
    pytest.importorskip("triton")
    stdout = run_interpreted(CHECK, timeout=240)
    assert stdout.count("rms_norm max error") == 8 and stdout.count("add_rms_norm exact") == 8, stdout
    assert "transformer max error" in stdout and "depformer logits max error" in stdout, stdout


def test_without_triton_on_cuda_nothing_is_fused():
    """On the CPU (no ``use_kernel``) the library's norms stay: its results bit for bit."""
    import torch
    from moshi.models import loaders
    from moshi.modules.transformer import RMSNorm

    from duplexserve.engine_bridge.moshi.fused_norm import install_fused_norms
    from duplexserve.engine_bridge.moshi.presets import get_preset

    lm = loaders.get_moshi_lm(None, lm_kwargs=get_preset("tiny").lm, device="cpu", dtype=torch.float32)
    before = sum(type(m) is RMSNorm for m in lm.modules())
    assert before > 0 and install_fused_norms(lm) == 0
    assert sum(type(m) is RMSNorm for m in lm.modules()) == before
