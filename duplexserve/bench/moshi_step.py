"""Where a batched moshi step goes on the GPU, before (stock attention) and after (live).

    breakdown  engine alone, every slot at a given session age: Mimi encode, the LM's
               main graph, the depformer graph, Mimi decode and the rest, timed with
               CUDA events; the GPU's busy time from the profiler, so that the time the
               GPU waits on Python is the step's wall time less it; the KV-read floor
               beside each row; Mimi's encode and decode alone, kernel by kernel.
    attention  one layer's attention alone: stock (moshi's per-layer positions and mask,
               SDPA over the whole ring) against the live-prefix kernel, by live length.
    agreement  each session of batched variants (attention, KV dtype, depformer, Mimi) against
               Kyutai's batch-1 loop and against the first variant, on the same weights,
               greedy: share of identical tokens (text, audio), the frame where the
               streams first part, the output audio's SNR (raw, and of the part that
               differs between inputs); and, as the floor, each session of the first
               variant against another input's.
    mimi       Mimi alone on one set of weights, its float32 matmuls in float32 against
               TF32 (--moshi-fp32-matmul): the share of identical codes from the same
               input, and the SNR of the audio decoded from the same codes.
    ring       Mimi's ring attention alone (16 calls in a CUDA graph): SDPA with the ring's
               mask against the Triton kernel at each tile, by batch and age.
    kernels    the kernels one depformer step launches (its ``dep_q`` codebook steps), stock
               moshi's against the engine's (lean depformer, fused norms), counted on the CPU:
               the torch operators that run a kernel on CUDA, and the Triton launches.
    sass       the tensor-core ring kernel compiled for sm_90 on this machine (``kernel_sass.py``):
               registers, and the instructions of its main loop a tile of the ring.
    moves      one slot's ``export_slot`` and ``import_slot`` (a session's live move, issue 76)
               in an engine of the first of --batches live rows, at each of --ages: the
               state's bytes, each call's wall time and the next step's.

Runs on CUDA but for ``kernels`` and ``sass`` (the numbers in docs/benchmarks.md come from one
H200); JSON to --out.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from duplexserve.bench.moshi_prompt import host_waits

FRAME = 1920
HBM_BYTES_PER_S = 4.4e12  # copy bandwidth measured on the H200 (reference/moshi_step.md)


def at_age(engine: Any, slots: np.ndarray, frames: np.ndarray, age: int) -> None:
    """Put every row at ``age`` frames into its session (every per-row clock moved): the
    LM's, and Mimi's transformers' (two positions a frame), whose rings of 250 fill in 10 s
    (at 512 rows a full ring's attention costs 6.8 ms against 1.9 at 60 positions). A step of
    ``slots`` first: it takes the rows' pending resets (every row is due one after the warm-up
    and after each ``resize``), which would otherwise put them back at frame 0."""
    engine.step(slots, frames)
    mimi = engine.mimi
    per_frame = round(mimi.encoder_frame_rate / mimi.frame_rate)
    transformers = [
        (engine.lm_gen.lm_model.transformer, age),
        (mimi.encoder_transformer.transformer, per_frame * age),
        (mimi.decoder_transformer.transformer, per_frame * age),
    ]
    for transformer, positions in transformers:
        transformer._streaming_state.offsets[:] = positions
        for layer in transformer.layers:
            state = layer.self_attn._streaming_state
            state.offset[:] = positions
            if hasattr(state.kv_cache, "end_offset"):  # moshi's ring; the 8-bit one keeps none
                state.kv_cache.end_offset[:] = positions
    engine.lm_gen._streaming_state.offsets[:] = age
    engine._steps[:] = age


class _Timed:
    """Wraps a callable so that each call is bracketed by CUDA events."""

    def __init__(self, torch: Any, fn: Any) -> None:
        self.torch, self.fn, self.spans = torch, fn, []

    def __call__(self, *args: Any) -> Any:
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.fn(*args)
        end.record()
        self.spans.append((start, end))
        return out

    def take_ms(self) -> float:
        total = sum(s.elapsed_time(e) for s, e in self.spans)
        n = len(self.spans)
        self.spans = []
        return total / max(n, 1)


def _kv_floor_ms(engine: Any, batch: int, live: int) -> float:
    """Reading ``live`` slots of every row's ring once, at the HBM's copy bandwidth."""
    from duplexserve.engine_bridge.moshi.memory import kv_bytes_per_slot

    lm = engine.lm_gen.lm_model
    attn = lm.transformer.layers[0].self_attn
    kv_dtype = engine.kv_dtype if engine.attention == "live" else "bf16"
    per_frame = kv_bytes_per_slot(
        len(lm.transformer.layers),
        attn.embed_dim,
        attn.num_heads,
        1,
        kv_dtype,
        next(lm.parameters()).element_size(),
        attn.kv_repeat,
    )
    return 1000 * batch * per_frame * live / HBM_BYTES_PER_S


def breakdown(engine: Any, batch: int, age: int, steps: int) -> dict[str, Any]:
    torch = engine._torch
    slots = np.arange(batch)
    frames = (np.random.default_rng(0).standard_normal((batch, FRAME)) * 0.05).astype(np.float32)
    state = engine.lm_gen._streaming_state
    mimi = engine._mimi_fns[batch]  # what a step of every row calls: its bucket's encode, decode
    parts = {
        "mimi_encode": _Timed(torch, mimi[0]),
        "main_graph": _Timed(torch, state.graphed_main),
        "depformer": _Timed(torch, state.graphed_depth),
        "mimi_decode": _Timed(torch, mimi[1]),
    }
    engine._mimi_fns[batch] = parts["mimi_encode"], parts["mimi_decode"]
    state.graphed_main, state.graphed_depth = parts["main_graph"], parts["depformer"]
    whole = _Timed(torch, engine.step)
    try:
        at_age(engine, slots, frames, age)
        for _ in range(3):
            whole(slots, frames)
        for t in (*parts.values(), whole):
            t.take_ms()
        wall = []
        host0 = engine.timings["host_s"]
        for _ in range(steps):
            t0 = time.perf_counter()
            whole(slots, frames)
            wall.append(time.perf_counter() - t0)
        row: dict[str, Any] = {name: t.take_ms() for name, t in parts.items()}
        span = whole.take_ms()
        row["other"] = span - sum(row.values())
        row["host_enqueue"] = 1000 * (engine.timings["host_s"] - host0) / steps
        row["gpu_span"] = span
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                whole(slots, frames)
        kernels = [k for k in prof.key_averages() if k.self_device_time_total > 0]
        busy_ms = sum(k.self_device_time_total for k in kernels) / 1000 / 5
        row["step_wall_p50"] = 1000 * float(np.median(wall))
        row["gpu_busy"] = busy_ms
        row["gpu_waits_on_host"] = max(0.0, row["step_wall_p50"] - busy_ms)
        row["top_kernels"] = _top_kernels(kernels, 5, 12)
        row["mimi_kernels"] = _mimi_kernels(torch, mimi, engine._in_dev[:batch], engine.lm_gen.lm_model.dep_q)
        waits: list[str] = []  # where the step's thread waits for the GPU (CUDA's sync debug mode)
        with host_waits(torch, waits, on=True):
            for _ in range(2):
                whole(slots, frames)
        whole.take_ms()
        row["host_waits"] = sorted(set(waits))
    finally:
        engine._mimi_fns[batch] = mimi
        state.graphed_main, state.graphed_depth = parts["main_graph"].fn, parts["depformer"].fn
    live = min(age + 1, engine.lm_gen.lm_model.transformer.layers[0].self_attn.context)
    row.update(batch=batch, age=age, kv_floor_live=_kv_floor_ms(engine, batch, live))
    row["gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def _top_kernels(kernels: list[Any], calls: int, top: int) -> list[tuple[str, float, int]]:
    """The ``top`` kernels by GPU time: name, ms and launches per call."""
    ranked = sorted(kernels, key=lambda k: -k.self_device_time_total)[:top]
    ms = [round(k.self_device_time_total / 1000 / calls, 3) for k in ranked]
    return [(k.key[:100], t, k.count // calls) for k, t in zip(ranked, ms, strict=True)]


def _mimi_kernels(torch: Any, fns: tuple[Any, Any], pcm: Any, codebooks: int) -> dict[str, Any]:
    """Mimi's encode and decode of a bucket, each called alone (its state moves on as in a
    step): where Mimi's share of the step goes, kernel by kernel."""
    encode, decode = fns
    codes = encode(pcm)[:, :codebooks].clamp(min=0).contiguous()
    parts: dict[str, Any] = {}
    for name, call in (("encode", lambda: encode(pcm)), ("decode", lambda: decode(codes))):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        kernels = [k for k in prof.key_averages() if k.self_device_time_total > 0]
        parts[name] = {
            "gpu_ms": sum(k.self_device_time_total for k in kernels) / 1000 / 5,
            "launches": sum(k.count for k in kernels) // 5,
            "top_kernels": _top_kernels(kernels, 5, 30),
        }
    return parts


def breakdown_builds(args: argparse.Namespace) -> list[tuple[str, ...]]:
    """The engines ``breakdown`` builds: ``--builds`` as listed (the library's whole path
    against the engine's, say, in two builds), else every combination of the per-part
    options. Each is (attention, depformer, Mimi attention, fp32 matmul, Mimi graph, convs)."""
    if args.builds:
        builds = [tuple(b.split("/")) for b in args.builds.split(",")]
        if any(len(b) != 6 for b in builds):
            raise SystemExit("--builds: attention/depformer/mimi attention/fp32 matmul/mimi graph/convs,...")
        return builds
    return list(
        itertools.product(
            args.attention.split(","), args.depformer.split(","), args.mimi_attention.split(","),
            args.fp32_matmul.split(","), args.mimi_graph.split(","), args.mimi_convs.split(","),
        )
    )  # fmt: skip


def cmd_breakdown(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from duplexserve.engine_bridge.moshi import live_attention
    from duplexserve.engine_bridge.moshi.engine import MoshiEngine
    from duplexserve.engine_bridge.moshi.live_attention import KernelConfig

    batches = [int(b) for b in args.batches.split(",")]
    ages = [int(a) for a in args.ages.split(",")]
    rows = []
    default = "DEFAULT_INT8" if args.kv_dtype == "int8" else "DEFAULT"  # the ring's kernel configuration
    kernels = [KernelConfig.parse(k) for k in args.kernels.split(",")] if args.kernels else [
        getattr(live_attention, default)
    ]
    builds = [(*build, k) for build in breakdown_builds(args) for k in kernels]
    for attention, depformer, mimi_attention, fp32_matmul, mimi_graph, mimi_convs, kernel in builds:
        setattr(live_attention, default, kernel)  # read when the CUDA graphs are captured
        engine = MoshiEngine(
            batches[0], args.preset, context=args.context, attention=attention, kv_dtype=args.kv_dtype,
            depformer=depformer, mimi_attention=mimi_attention, fp32_matmul=fp32_matmul,
            mimi_graph=mimi_graph, mimi_convs=mimi_convs,
        )  # fmt: skip
        engine.start()
        for b in batches:
            if b != engine.num_slots:
                engine.resize(b)
            for age in ages:
                row = {
                    "attention": attention,
                    "kv_dtype": args.kv_dtype,
                    "depformer_attention": depformer,
                    "mimi_attention": mimi_attention,
                    "fp32_matmul": fp32_matmul,
                    "mimi_graph": mimi_graph,
                    "mimi_convs": mimi_convs,
                    "kernel": str(kernel),
                    **breakdown(engine, b, age, args.steps),
                }
                rows.append(row)
                listed = ("top_kernels", "host_waits", "mimi_kernels")
                print(json.dumps({k: v for k, v in row.items() if k not in listed}))
        print(json.dumps(rows[-1]["top_kernels"]), flush=True)
        print("where a step waits for the GPU:", *rows[-1]["host_waits"] or ["nowhere"], sep="\n")
        engine.stop()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    print(f"{'lm/dep/mimi/mm/gr/cv':>17} {'B':>4} {'age':>5} {'wall':>6} {'enc':>5} {'main':>5} {'depf':>5} "
          f"{'dec':>5} {'other':>5} {'busy':>5} {'host':>5} {'KVfloor':>7}")  # fmt: skip
    kinds = ("attention", "depformer_attention", "mimi_attention", "fp32_matmul", "mimi_graph", "mimi_convs")
    for r in rows:
        print(
            f"{'/'.join(r[k][:2] for k in kinds):>17} "
            f"{r['batch']:>4} {r['age']:>5} "
            f"{r['step_wall_p50']:6.1f} "
            f"{r['mimi_encode']:5.1f} {r['main_graph']:5.1f} {r['depformer']:5.1f} {r['mimi_decode']:5.1f} "
            f"{r['other']:5.1f} {r['gpu_busy']:5.1f} {r['host_enqueue']:5.1f} {r['kv_floor_live']:7.1f}"
        )
    return rows


def cmd_attention(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One layer of the hibiki-2b-class shape (16 heads of 128, ring 3000), bf16 or int8;
    ``--kv-repeat 2``: Hibiki-Zero's 8 KV heads, which stock moshi repeats every layer. Each
    kernel's largest error (``*_rel_err``, of the largest value) is against float32 SDPA over
    the same (dequantized) prefix; stock's, at the whole ring, is bf16's own yardstick."""
    import torch
    import torch.nn.functional as F
    from moshi.modules.transformer import expand_repeated_kv

    from duplexserve.engine_bridge.moshi.live_attention import (
        DEFAULT,
        DEFAULT_INT8,
        KernelConfig,
        dequantize,
        live_attention,
        prefix_mask,
        quantize,
        reference_attention,
    )

    int8 = args.kv_dtype == "int8"
    configs = [KernelConfig.parse(c) for c in args.kernels.split(",")] if args.kernels else [
        DEFAULT_INT8 if int8 else DEFAULT
    ]
    heads, dim, cap, repeat = 16, 128, args.context or 3000, args.kv_repeat
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        ring = torch.randn(2, b, heads // repeat, cap, dim, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(b, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
        end = torch.full((b,), cap, device="cuda", dtype=torch.long)
        ring8, scales = quantize(ring) if int8 else (ring, None)

        def stock(
            q: Any = q, ring: Any = ring, end: Any = end
        ) -> Any:  # moshi's per-layer positions, mask and SDPA over the whole ring (bf16)
            idx = torch.arange(cap, device="cuda")
            last = end.view(-1, 1)
            delta = idx - last % cap
            pos = torch.where(delta <= 0, last + delta, last + delta - cap)
            pos = torch.where(idx >= end.view(-1, 1), torch.full_like(pos, -1), pos)
            d = end.view(-1, 1, 1) - pos[:, None]
            bias = ((pos[:, None] >= 0) & (d >= 0) & (d < cap))[:, None]
            keys, values = (expand_repeated_kv(x, repeat) for x in ring) if repeat > 1 else ring
            return F.scaled_dot_product_attention(q, keys, values, bias)

        for share in (1.0, 0.5, 0.25, 0.125):
            lengths = torch.full((b,), max(1, int(cap * share)), device="cuda", dtype=torch.int32)
            row = {"batch": b, "live_share": share, "kv_dtype": args.kv_dtype, "kv_repeat": repeat}
            variants: list[tuple[str, Any]] = [("stock", stock)]
            pair = None if scales is None else (scales[0], scales[1])
            for c in configs:
                variants.append(
                    (f"live_{c}", partial(live_attention, q, ring8[0], ring8[1], lengths, pair, c))
                )
            # what every kernel should give, in float32: SDPA over the (dequantized) live prefix;
            # stock's error is against the whole ring it reads (share 1.0)
            keys, values = dequantize(ring8, scales, torch.float32) if int8 else ring.float()
            truth = reference_attention(q.float(), keys, values, prefix_mask(lengths, cap))
            del keys, values
            for name, fn in variants:
                try:
                    out = fn()
                except Exception as exc:  # a configuration that does not compile costs its row only
                    row[f"{name}_error"] = repr(exc)[:200]
                    continue
                if name != "stock" or (share == 1.0 and not int8):
                    row[f"{name}_rel_err"] = ((out.float() - truth).abs().max() / truth.abs().max()).item()
                for _ in range(3):
                    fn()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.steps):
                    fn()
                stop.record()
                torch.cuda.synchronize()
                row[f"{name}_ms"] = start.elapsed_time(stop) / args.steps
            slot_bytes = dim + 2 if int8 else dim * 2  # int8: the bytes and a bf16 scale
            row["floor_ms"] = 1000 * b * 2 * (heads // repeat) * slot_bytes * cap * share / HBM_BYTES_PER_S
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ring, ring8, scales
    return rows


def cmd_ring(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Mimi's ring attention alone (8 heads of 64, float32, a ring of 250, 2 queries a step)
    at each batch and age: 16 calls (Mimi's encoder and decoder layers) in one CUDA graph,
    SDPA with the ring's mask (moshi's way) against the kernel at each of ``--tiles``."""
    import torch

    from duplexserve.engine_bridge.moshi.ring_attention import reference, ring_attention

    heads, dim, cap, t, calls = 8, 64, args.context or 250, 2, 16
    parsed = (x.split("/") for x in args.tiles.split(","))
    tiles = [(int(n), int(w), form == ["rows"]) for n, w, *form in parsed]
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        qkv = torch.randn(b, t, 3, heads, dim, device="cuda")  # in_proj's output, as moshi splits it
        q = qkv[:, :, 0].transpose(1, 2)  # [B, H, T, D], strided
        cache = torch.randn(2, b, heads, cap, dim, device="cuda")
        for age in [int(x) for x in args.ages.split(",")]:
            ends = torch.full((b,), 2 * age - t, device="cuda", dtype=torch.long)
            held = min(2 * age, cap)
            row: dict[str, Any] = {"batch": b, "age": age, "held": held}
            row["floor_ms"] = 1000 * calls * b * 2 * heads * held * dim * 4 / HBM_BYTES_PER_S
            written = ends + t  # the reference counts this step's positions as written
            truth = reference(q, cache[0], cache[1], written)
            variants = [("sdpa", partial(reference, q, cache[0], cache[1], written))]
            for tile in tiles:
                name = "kernel/{}/{}{}".format(*tile[:2], "/rows" if tile[2] else "")
                variants.append((name, partial(ring_attention, q, cache[0], cache[1], ends, tile)))
            for name, fn in variants:
                try:
                    out = fn()
                    row[f"{name}_max_err"] = (out - truth).abs().max().item()
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for _ in range(calls):
                            fn()
                except Exception as exc:  # a tile that does not compile costs its column only
                    row[f"{name}_error"] = repr(exc)[:200]
                    continue
                for _ in range(3):
                    graph.replay()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.steps):
                    graph.replay()
                stop.record()
                torch.cuda.synchronize()
                row[f"{name}_ms"] = start.elapsed_time(stop) / args.steps
                del graph
            rows.append(row)
            print(json.dumps(row), flush=True)
        del qkv, cache
    return rows


def _run_batched(engine: Any, inputs: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Sessions opening at different steps and skipping some, in one batch: audio, tokens."""
    from duplexserve.engine_bridge.moshi.reference import lm_tokens

    n, frames = len(inputs), len(inputs[0])
    starts = [0, 0, 3, 7, 11, 20][:n]
    audio: list[list[np.ndarray]] = [[] for _ in range(n)]
    tokens: list[list[np.ndarray]] = [[] for _ in range(n)]
    sent, step = [0] * n, 0
    with lm_tokens(engine) as captured:
        while any(s < frames for s in sent):
            for i in range(n):
                if step == starts[i]:
                    engine.open(i, {})
            rows = [i for i in range(n) if step >= starts[i] and sent[i] < frames and step % 9 != i]
            if rows:
                result = engine.step(np.array(rows), np.stack([inputs[i][sent[i]] for i in rows]))
                tok = captured.pop().cpu().numpy()
                where = engine.rows_of(np.array(rows))  # the slots' rows in LMGen's batch
                for r, i in enumerate(rows):
                    audio[i].append(result.audio[r].copy())
                    tokens[i].append(tok[where[r], :, 0])
                    sent[i] += 1
            step += 1
    skip = engine.delay_frames
    return [np.stack(a) for a in audio], [np.stack(t[skip:]) for t in tokens]


def _kyutai(engine: Any, inputs: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Kyutai's batch-1 server loop on stock modules holding the engine's weights."""
    from duplexserve.engine_bridge.moshi.reference import server_loop, stock_models

    models = stock_models(engine, engine.context)
    runs = [server_loop(models, x, engine.cfg_coef) for x in inputs]
    return [audio for audio, _ in runs], [tokens for _, tokens in runs]


def _snr_db(signal: float, noise: float) -> float:
    return float(10 * np.log10(max(signal, 1e-30) / max(noise, 1e-30)))


def _snrs(got: list[np.ndarray], ref: list[np.ndarray]) -> tuple[list[float], list[float]]:
    """Each session's audio SNR against its reference: raw, and of the part of the reference
    that is not common to all its sessions (a random decoder's bias response is)."""
    common = np.mean(ref, axis=0)
    pairs = list(zip(got, ref, strict=True))
    raw = [_snr_db((r**2).sum(), ((a - r) ** 2).sum()) for a, r in pairs]
    varying = [_snr_db(((r - common) ** 2).sum(), ((a - r) ** 2).sum()) for a, r in pairs]
    return raw, varying


def _compare(name: str, got: tuple, ref: tuple) -> dict[str, Any]:
    """Share of identical tokens (all, text, audio), where the streams first part, and the
    SNR of ``got``'s audio against ``ref``'s: raw, and with the part of ``ref`` common to
    all its sessions taken out of the signal (a random Mimi decoder's output is mostly
    its biases' response, the same whatever the tokens, which inflates the raw figure)."""
    same = sum(int((g == r).sum()) for g, r in zip(got[1], ref[1], strict=True))
    total = sum(r.size for r in ref[1])
    text = sum(int((g[:, 0] == r[:, 0]).sum()) for g, r in zip(got[1], ref[1], strict=True))
    audio = sum(int((g[:, 1:] == r[:, 1:]).sum()) for g, r in zip(got[1], ref[1], strict=True))
    first = [
        int(np.flatnonzero((g != r).any(axis=1))[0]) if (g != r).any() else len(r)
        for g, r in zip(got[1], ref[1], strict=True)
    ]
    snrs, varying = _snrs(got[0], ref[0])
    text_total = sum(len(r) for r in ref[1])
    return {"pair": name, "identical_tokens": same / total, "identical_text_tokens": text / text_total,
            "identical_audio_tokens": audio / (total - text_total),
            "first_different_frame": first, "first_different_frame_median": float(np.median(first)),
            "snr_db_min": float(min(snrs)), "snr_db_median": float(np.median(snrs)),
            "snr_varying_db_min": float(min(varying)),
            "snr_varying_db_median": float(np.median(varying))}  # fmt: skip


def _unrelated(result: tuple) -> tuple:
    """The same variant's sessions shifted by one: each compared with another input's
    answer, the floor that SNR and agreement take when the audio carries nothing of it."""
    return result[0][1:] + result[0][:1], result[1][1:] + result[1][:1]


def _weights(engine: Any) -> tuple[dict, dict]:
    """A copy of the first build's weights (Mimi's, the LM's) for ``_load_weights``."""
    def copy(module: Any) -> dict:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    return copy(engine.mimi), copy(engine.lm_gen.lm_model)


def _load_weights(engine: Any, saved: tuple[dict, dict]) -> int:
    """Give ``engine`` the first variant's weights (the random presets are rebuilt per
    variant, and CUDA's k-means of the codebooks need not repeat bit for bit); the
    number of tensors that differed."""
    import torch

    differed = 0
    for module, state in zip((engine.mimi, engine.lm_gen.lm_model), saved, strict=True):
        own = module.state_dict()
        differed += sum(1 for k, v in state.items() if not torch.equal(own[k], v))
        module.load_state_dict(state)
    for m in engine.mimi.modules():  # the codebooks cache their centroids (not in the state dict)
        cached = getattr(m, "_embedding", None)
        if isinstance(cached, torch.Tensor) and hasattr(m, "embedding_sum"):
            cached.copy_(m.embedding_sum / m.cluster_usage.clamp(min=m.epsilon)[:, None])
    return differed


def cmd_agreement(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Batched variants (attention/kv dtype[/depformer[/mimi attention]]) against Kyutai's batch-1 loop and
    the first variant, all on the first variant's weights."""
    import torch

    from duplexserve.engine_bridge.moshi.engine import MoshiEngine, Sampling

    inputs = [
        (np.random.default_rng(i).standard_normal((args.frames, FRAME)) * 0.1).astype(np.float32)
        for i in range(6)
    ]
    results: dict[str, tuple] = {}
    differed: dict[str, int] = {}
    saved: tuple[dict, dict] | None = None
    engine = None
    variants = args.variants.split(",")
    for variant in variants:
        attention, kv_dtype, *rest = variant.split("/")
        engine = MoshiEngine(
            8, args.preset, sampling=Sampling(greedy=True), attention=attention, kv_dtype=kv_dtype,
            depformer=rest[0] if rest else "stock", mimi_attention=rest[1] if rest[1:] else "stock",
            fp32_matmul=rest[2] if rest[2:] else "float32", mimi_graph=rest[3] if rest[3:] else "whole",
        )  # fmt: skip
        engine.start()
        if saved is None:
            saved = _weights(engine)
        else:
            with torch.no_grad():
                differed[variant] = _load_weights(engine, saved)
            print(f"{variant}: {differed[variant]} tensors differed from the first build", flush=True)
        t = time.perf_counter()
        results[variant] = _run_batched(engine, inputs)
        print(f"{variant}: {time.perf_counter() - t:.1f} s", flush=True)
        if variant != variants[-1]:
            engine.stop()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    assert engine is not None
    t = time.perf_counter()
    reference = _kyutai(engine, inputs)
    print(f"kyutai batch-1: {time.perf_counter() - t:.1f} s", flush=True)
    engine.stop()
    first = variants[0]
    base = {"preset": args.preset, "frames": args.frames, "sessions": len(inputs)}
    rows = [{**base, **_compare(f"{v} vs kyutai batch-1", r, reference)} for v, r in results.items()]
    rows += [
        {**base, **_compare(f"{v} vs {first}", r, results[first])} for v, r in results.items() if v != first
    ]
    rows.append({**base, **_compare(f"{first}: each session vs another input's", _unrelated(results[first]),
                                    results[first])})  # fmt: skip
    rows.append({**base, "pair": "builds", "tensors_differing_from_first_build": differed})
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def _mimi_input(slots: int, samples: int, path: str) -> np.ndarray:
    """``slots`` rows of ``samples`` at 24 kHz: noise at levels from -30 to -10 dBFS, or a
    recording (``--audio``: speech is what a trained Mimi is for), each row from its own
    offset into it, repeated where it is short."""
    if not path:
        rng = np.random.default_rng(0)
        return (rng.standard_normal((slots, samples)) * rng.uniform(0.02, 0.3, (slots, 1))).astype(np.float32)
    from duplexserve.engine_bridge.moshi.prompts import read_recording

    mono = read_recording(path)
    starts = np.arange(slots)[:, None] * (len(mono) // slots)
    return mono[(starts + np.arange(samples)) % len(mono)].astype(np.float32)


def _mimi_pass(engine: Any, audio: np.ndarray, codes: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Every slot through the engine's streaming Mimi (its CUDA graphs, as the engine calls
    them): the codes of ``audio`` (slots x samples), then the audio decoded from ``codes``
    (or from its own)."""
    import torch

    mimi, device = engine.mimi, engine.device
    encode, decode = engine._mimi_encode, engine._mimi_decode  # a whole graph's output is reused: clone
    b, frames = audio.shape[0], audio.shape[1] // FRAME
    every = torch.ones(b, dtype=torch.bool, device=device)
    with torch.no_grad():
        engine._mask_dev.fill_(True)
        mimi.reset_streaming(every)
        x = torch.from_numpy(audio).to(device)[:, None, :]
        frame_of = [x[..., t * FRAME : (t + 1) * FRAME].contiguous() for t in range(frames)]
        got = torch.cat([encode(f).clone() for f in frame_of], dim=-1)
        feed = got if codes is None else torch.from_numpy(codes).to(device)
        mimi.reset_streaming(every)
        pcm = torch.cat([decode(feed[..., t : t + 1].contiguous()).clone() for t in range(frames)], dim=-1)
    return got.cpu().numpy(), pcm[:, 0].float().cpu().numpy()


# torch operators that launch no kernel of their own on CUDA: views, allocations, and calls that
# launch through their children or, where they return their input, not at all
_NO_KERNEL = frozenset((
    "as_strided", "view", "empty", "empty_strided", "empty_like", "resize_", "_unsafe_view", "alias",
    "resolve_conj", "result_type", "t", "transpose", "reshape", "_reshape_alias", "slice", "select",
    "unsqueeze", "squeeze", "expand", "permute", "narrow", "split", "chunk", "unbind", "detach", "lift_fresh",
    "contiguous", "to", "_to_copy", "linear", "matmul", "scaled_dot_product_attention", "softmax",
    "layer_norm", "zeros",
))  # fmt: skip


def _runs_kernel(name: str) -> bool:
    return name.startswith("aten::") and name[6:] not in _NO_KERNEL


def _counted(counter: Any, name: str, outputs: int = 1) -> Any:
    """A stand-in for a Triton launch: counts it and allocates its output (``outputs`` of them,
    shaped as its first argument) without a kernel."""
    import torch

    def run(*args: Any, **kwargs: Any) -> Any:
        counter[name] += 1
        made = tuple(torch.empty_like(args[0]) for _ in range(outputs))
        return made if outputs > 1 else made[0]

    return run


def cmd_kernels(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One ``LMGen.depformer_step`` of ``--preset`` (its depformer ``--depformer-layers`` deep where
    given: what a layer and codebook step launches does not depend on the widths), stock and lean,
    on the CPU with the Triton kernels counted where the engine's CUDA path would launch them."""
    import collections
    from unittest import mock

    import torch
    from moshi.models import LMGen, loaders

    from duplexserve.engine_bridge.moshi import fused_norm, lean_depformer
    from duplexserve.engine_bridge.moshi.presets import get_preset

    preset = get_preset(args.preset)
    kwargs = dict(preset.lm)
    if args.depformer_layers:
        kwargs["depformer_num_layers"] = args.depformer_layers
    rows = []
    for variant in ("stock", "lean"):
        torch.manual_seed(0)
        lm = loaders.get_moshi_lm(None, lm_kwargs=kwargs, device="cpu", dtype=torch.float32)
        triton: collections.Counter[str] = collections.Counter()
        norms = lean = 0
        if variant == "lean":
            lean = lean_depformer.install_lean_depformer(lm, use_kernel=True)
            norms = fused_norm.install_fused_norms(lm, use_kernel=True)
        gen = LMGen(lm, **preset.lm_gen_config)
        batch = 4
        text, out = torch.zeros(batch, dtype=torch.long), torch.randn(batch, 1, lm.dim)
        with (
            mock.patch.object(lean_depformer, "ring_attention", _counted(triton, "ring_attention")),
            mock.patch.object(fused_norm, "rms_norm", _counted(triton, "rms_norm")),
            mock.patch.object(fused_norm, "add_rms_norm", _counted(triton, "add_rms_norm", outputs=2)),
            torch.no_grad(),
        ):
            gen.depformer_step(text, out)
            triton.clear()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                gen.depformer_step(text, out)
        ops = collections.Counter(
            e.key for e in prof.events()
            if _runs_kernel(e.key) and not any(_runs_kernel(c.name) for c in e.cpu_children)
        )  # fmt: skip
        row = {
            "preset": args.preset, "variant": variant, "depformer_layers": len(lm.depformer.layers),
            "codebook_steps": lm.dep_q, "lean_depformer": bool(lean), "fused_norms": norms,
            "kernels": sum(ops.values()) + sum(triton.values()), "torch_ops": dict(ops.most_common()),
            "triton": dict(triton),
        }  # fmt: skip
        print(json.dumps({k: v for k, v in row.items() if k != "torch_ops"}), flush=True)
        rows.append(row)
    return rows


def cmd_mimi(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Mimi alone, builds (fp32 matmul/graph) against the first, on the first build's weights:
    TF32 against float32, or Mimi as whole CUDA graphs against the library's graphs."""
    import torch

    from duplexserve.engine_bridge.moshi.engine import MoshiEngine

    slots = 8
    audio = _mimi_input(slots, args.frames * FRAME, args.audio)
    runs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    saved: tuple[dict, dict] | None = None
    builds = args.mimi_builds.split(",")
    for build in builds:
        precision, graph, *convs = build.split("/")
        engine = MoshiEngine(
            slots, args.preset, hf_repo=args.hf_repo, attention="live", mimi_attention=args.mimi_attention,
            fp32_matmul=precision, mimi_graph=graph, mimi_convs=convs[0] if convs else "fused",
        )  # fmt: skip
        engine.start()
        if not args.hf_repo:  # a random preset is rebuilt per build: each gets the first's weights
            if saved is None:
                saved = _weights(engine)
            else:
                _load_weights(engine, saved)
        reference = runs.get(builds[0])
        runs[build] = _mimi_pass(engine, audio, reference[0] if reference else None)
        engine.stop()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    rows = []
    codes, pcm = runs[builds[0]]
    for build in builds[1:]:
        other_codes, other_pcm = runs[build]
        snrs, varying = _snrs(list(other_pcm), list(pcm))
        row = {
            "preset": args.hf_repo or args.preset, "audio": args.audio or "noise", "frames": args.frames,
            "sessions": slots, "mimi_attention": args.mimi_attention, "pair": f"{build} vs {builds[0]}",
            "identical_codes": float((codes == other_codes).mean()),
            "identical_codes_first_codebook": float((codes[:, 0] == other_codes[:, 0]).mean()),
            "identical_codes_by_codebook": [round(float(v), 4) for v in (codes == other_codes).mean((0, 2))],
            "identical_audio_samples": float((pcm == other_pcm).mean()),
            "decode_snr_db": [round(v, 1) for v in snrs],
            "decode_snr_varying_db": [round(v, 1) for v in varying],
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def cmd_sass(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The tensor-core ring kernel for ``--kv-dtype`` at each of ``--kernels`` (default the
    engine's), compiled for sm_90 on this machine: its main loop's instructions; reading a ring,
    then a page pool (paged KV: only where a chunk starts differs)."""
    from duplexserve.bench.kernel_sass import loop_counts
    from duplexserve.engine_bridge.moshi.live_attention import DEFAULT, DEFAULT_INT8, KernelConfig

    default = DEFAULT_INT8 if args.kv_dtype == "int8" else DEFAULT
    configs = [KernelConfig.parse(k) for k in args.kernels.split(",")] if args.kernels else [default]
    rows = []
    for config in configs:
        for paged in (False, True):
            row = loop_counts(args.kv_dtype, config, paged=paged)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def cmd_moves(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Slot 0 exported, closed and imported back, ``--steps`` times at each age (medians)."""
    import torch

    from duplexserve.engine_bridge.moshi.engine import MoshiEngine, Sampling

    batch = int(args.batches.split(",")[0])
    engine = MoshiEngine(
        batch, args.preset, context=args.context, kv_dtype=args.kv_dtype, sampling=Sampling(greedy=True)
    )
    engine.start()
    cuda = engine.device.type == "cuda"
    slots = np.arange(batch)
    for slot in slots.tolist():
        engine.open(slot, {})
    frames = np.zeros((batch, FRAME), dtype=np.float32)

    def timed(call: Any) -> tuple[Any, float]:
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        out = call()
        if cuda:
            torch.cuda.synchronize()
        return out, 1000 * (time.perf_counter() - began)

    rows = []
    for age in (int(a) for a in args.ages.split(",")):
        at_age(engine, slots, frames, age)
        spans: dict[str, list[float]] = {"export_ms": [], "import_ms": [], "step_ms": []}
        size = 0
        for _ in range(max(1, args.steps)):
            state, ms = timed(lambda: engine.export_slot(0))
            spans["export_ms"].append(ms)
            size = len(state)
            engine.close(0)
            spans["import_ms"].append(timed(lambda state=state: engine.import_slot(0, state))[1])
            spans["step_ms"].append(timed(lambda: engine.step(slots, frames))[1])
        row = {
            "preset": args.preset, "kv_dtype": args.kv_dtype, "batch": batch, "age": age, "bytes": size,
            **{k: round(float(np.median(v)), 2) for k, v in spans.items()},
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    engine.stop()
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="part", required=True)
    for name in ("breakdown", "attention", "agreement", "mimi", "ring", "kernels", "sass", "moves"):
        p = sub.add_parser(name)
        p.add_argument("--preset", default="hibiki-2b-class")
        p.add_argument("--batches", default="1,32,64,128,192,224")
        p.add_argument("--ages", default="375,2999", help="frames into each session (breakdown)")
        p.add_argument("--attention", default="stock,live")
        p.add_argument("--kv-dtype", default="bf16", help="breakdown: bf16 or int8")
        p.add_argument(
            "--variants", default="live/bf16,live/int8,stock/bf16",
            help="agreement: attention/kv dtype[/depformer[/mimi attention[/fp32 matmul[/mimi graph]]]],..."
            " (the first is the base; Kyutai's batch-1 loop runs after the last, with its fp32 matmul)",
        )  # fmt: skip
        p.add_argument("--depformer", default="lean", help="breakdown: lean,stock (each its own engine)")
        p.add_argument("--mimi-attention", default="live", help="breakdown: stock,live (each its own engine)")
        p.add_argument("--fp32-matmul", default="float32", help="breakdown: float32,tf32 (one engine each)")
        p.add_argument("--mimi-graph", default="whole", help="breakdown: parts,whole (one engine each)")
        p.add_argument("--mimi-convs", default="fused", help="breakdown: stock,fused,fused-cl (each)")
        p.add_argument(
            "--builds", default="",
            help="breakdown: attention/depformer/mimi attention/fp32 matmul/mimi graph/convs,... instead of"
            " every combination of the options above (stock/stock/stock/float32/parts/stock: the library's)",
        )  # fmt: skip
        p.add_argument(
            "--mimi-builds", default="float32/whole,tf32/whole",
            help="mimi: fp32 matmul/graph[/convs: stock, fused or fused-cl],... (each against the first)",
        )  # fmt: skip
        p.add_argument("--context", type=int, default=0)
        p.add_argument("--depformer-layers", type=int, default=0, help="kernels: the depformer's depth")
        p.add_argument("--kv-repeat", type=int, default=1, help="attention: query heads per KV head")
        p.add_argument("--steps", type=int, default=30)
        p.add_argument("--frames", type=int, default=60, help="frames per session (agreement, mimi)")
        p.add_argument(
            "--kernels", default="",
            help="chunk/block/warps/stages[/read],...: the --kv-dtype ring's kernels, attention's to time, "
            "breakdown's one engine each (default the engine's)",
        )  # fmt: skip
        p.add_argument(
            "--tiles", default="64/4,32/4,16/4,64/4/rows,64/8/rows,32/4/rows,32/2/rows,16/4/rows,16/2/rows",
            help="ring: slots per iteration/warps[/rows: one query at a time],... of Mimi's ring kernel",
        )  # fmt: skip
        p.add_argument(
            "--hf-repo", default="",
            help="mimi: a checkpoint in the local Hugging Face cache (serve's --moshi-hf-repo) instead of"
            " --preset's random weights",
        )  # fmt: skip
        p.add_argument("--audio", default="", help="mimi: a recording to encode (any rate) instead of noise")
        p.add_argument("--out", default="")


def run(args: argparse.Namespace) -> None:
    parts = {
        "breakdown": cmd_breakdown, "attention": cmd_attention, "agreement": cmd_agreement, "mimi": cmd_mimi,
        "ring": cmd_ring, "kernels": cmd_kernels, "sass": cmd_sass, "moves": cmd_moves,
    }  # fmt: skip
    rows = parts[args.part](args)
    if args.out:
        Path(args.out).write_text(json.dumps({"part": args.part, "args": vars(args), "rows": rows}, indent=1))
