"""The paged KV read and write on a GPU against the ring's (issue 74): bit for bit, and timed.

Needs only torch and Triton (live_attention.py is loaded by its path, not through the
package), so it runs on a bare GPU host: ``python3 scripts/check-paged-kv.py [rows]``.
For each ring kernel (bf16 and int8 through the tensor cores, int8 "bits", float32 "cast") a
batch of rows with lengths from 0 to the full context is read from a ring and from the same
keys scattered over shuffled pages of a pool: the outputs must be equal, bit for bit. Then
both reads are timed at Hibiki-Zero 3B's layer shape (8 KV heads of 128, two query heads
each, a 3000-frame context), rows at 60 s and at uniform ages, and printed as JSON lines.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import torch

PATH = Path(__file__).resolve().parents[1] / "duplexserve/engine_bridge/moshi/live_attention.py"
spec = importlib.util.spec_from_file_location("live_attention", PATH)
la = importlib.util.module_from_spec(spec)
sys.modules["live_attention"] = la
spec.loader.exec_module(la)  # type: ignore[union-attr]

PAGE, CONTEXT, KV, GROUP, D = 512, 3000, 8, 2, 128


def scatter(ring: torch.Tensor, pages: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring's rows ``[2, B, KV, C, ...]`` laid over shuffled pages of a pool, and the table."""
    b = ring.shape[1]
    per_row = -(-CONTEXT // PAGE)
    order = torch.randperm(pages - 1, generator=generator)[: b * per_row] + 1
    table = order.view(b, per_row).to(torch.int32)
    pad = per_row * PAGE - CONTEXT
    padded = torch.nn.functional.pad(ring, (0, 0, 0, pad) if ring.dim() == 5 else (0, pad))
    chunks = padded.unflatten(3, (per_row, PAGE)).movedim(3, 2)  # [2, B, per_row, KV, PAGE, ...]
    pool = torch.zeros((2, pages, *chunks.shape[3:]), dtype=ring.dtype, device=ring.device)
    pool[:, table.long().flatten()] = chunks.flatten(1, 2)
    return pool, table.to(ring.device)


def main(rows: int) -> None:
    g = torch.Generator().manual_seed(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: TRITON_INTERPRET=1
    lengths = torch.randint(0, CONTEXT + 1, (rows,), generator=g).to(torch.int32)
    lengths[:4] = torch.tensor([0, 1, PAGE, CONTEXT], dtype=torch.int32)
    lengths = lengths.to(dev)
    q = torch.randn(rows, KV * GROUP, 1, D, generator=g).to(dev, torch.bfloat16)
    ring = torch.empty(2, rows, KV, CONTEXT, D, device=dev, dtype=torch.bfloat16).normal_()  # made there
    pages = 1 + rows * -(-CONTEXT // PAGE) + 7
    pool, table = scatter(ring, pages, g)
    ring8, scale = la.quantize(ring)
    pool8, table8 = scatter(ring8, pages, g)
    # the scales follow the bytes' pages (the bytes' table)
    pool_scale = torch.zeros((2, pages, KV, PAGE), dtype=scale.dtype, device=dev)
    per_row = table8.shape[1]
    padded = torch.nn.functional.pad(scale, (0, per_row * PAGE - CONTEXT)).unflatten(3, (per_row, PAGE))
    pool_scale[:, table8.long().flatten()] = padded.movedim(3, 2).flatten(1, 2)
    cases = [
        ("bf16", "mma", ring, pool, table, None, None),
        ("int8", "mma", ring8, pool8, table8, scale, pool_scale),
        ("int8", "bits", ring8, pool8, table8, scale, pool_scale),
    ]
    for kv_dtype, read, r, p, t, rs, ps in cases:
        config = la.KernelConfig(chunk=PAGE, block_n=16, warps=1, read=read)
        pair = None if rs is None else (rs[0], rs[1])
        pool_pair = None if ps is None else (ps[0], ps[1])
        want = la.live_attention(q, r[0], r[1], lengths, pair, config)
        got = la.live_attention(q, p[0], p[1], lengths, pool_pair, config, table=t, capacity=CONTEXT)
        same = torch.equal(got, want)
        print(json.dumps({"check": "paged equals ring", "kv_dtype": kv_dtype, "read": read, "rows": rows,
                          "equal": same, "max_diff": (got.float() - want.float()).abs().max().item()}))
        assert same, (kv_dtype, read)
    # the fused int8 write: a page and an offset a row against a row and a slot
    k, v = torch.randn(2, rows, KV, 1, D, generator=g).to(dev, torch.bfloat16)
    slot = torch.randint(0, PAGE, (rows,), generator=g).to(dev)
    at = (torch.randperm(pages - 1, generator=g)[:rows] + 1).to(dev)
    pooled = torch.zeros(2, pages, KV, PAGE, D, dtype=torch.int8, device=dev), torch.zeros(
        2, pages, KV, PAGE, dtype=torch.bfloat16, device=dev)
    la.write_quantized(k, v, *pooled, slot, page=at)
    rowed = torch.zeros(2, rows, KV, PAGE, D, dtype=torch.int8, device=dev), torch.zeros(
        2, rows, KV, PAGE, dtype=torch.bfloat16, device=dev)
    la.write_quantized(k, v, *rowed, slot)
    same = torch.equal(pooled[0][:, at], rowed[0]) and torch.equal(pooled[1][:, at], rowed[1])
    print(json.dumps({"check": "paged write equals ring", "equal": same}))
    assert same
    if dev.type != "cuda":
        return
    from triton.testing import do_bench

    for share, label in ((None, "uniform ages"), (750, "60 s each")):
        live = lengths if share is None else torch.full_like(lengths, share)
        for kv_dtype, read, r, p, t, rs, ps in cases[:2]:
            config = la.KernelConfig(chunk=PAGE, block_n=16, warps=1, read=read)
            pair = None if rs is None else (rs[0], rs[1])
            pool_pair = None if ps is None else (ps[0], ps[1])
            ringed = functools.partial(la.live_attention, q, r[0], r[1], live, pair, config)
            ms_ring = do_bench(ringed, rep=200)
            paged = functools.partial(la.live_attention, q, p[0], p[1], live, pool_pair, config, table=t,
                                      capacity=CONTEXT)  # fmt: skip
            ms_paged = do_bench(paged, rep=200)
            print(json.dumps({"time": "one layer's decode attention", "kv_dtype": kv_dtype, "rows": rows,
                              "lengths": label, "ring_ms": round(ms_ring, 4), "paged_ms": round(ms_paged, 4),
                              "device": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 512)
