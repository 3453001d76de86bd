"""What each codec path costs per 80 ms frame, and where it should run.

``duplexserve bench codec-costs [--json out.json]`` measures, in one process:

1. ``paths``: CPU time of one thread per frame to decode and to encode each wire format,
   80 ms messages of speech made with espeak-ng (the inline cost on the event loop).
   ``opus_signals``: Opus by kind of signal, since libopus's mode, set by the signal,
   decides its cost.
2. ``gil``: whether soxr and sphn release the GIL. A pure-Python counter runs on the
   main thread beside a thread calling the codec in a loop, and beside two references:
   hashing 1 MB (C code that releases the GIL) and ``sum`` over a range (C code that
   holds it). The score places each codec between them: 1.0 releases, 0.0 holds.
3. ``hop``: what one thread-pool hop costs (``run_in_executor`` of a no-op from asyncio),
   on the loop thread and in all.
4. ``opus_offload``: 64 Opus sessions at once, each decoding and encoding frames, run
   inline, on a thread pool and on codec worker processes: CPU per frame of the loop
   thread, of this whole process (whose threads share one GIL) and of the workers, and
   wall time. This is the measurement behind the offload policy in docs/codecs.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from duplexserve.bench.signals import espeak_speech, model_signal, speechlike
from duplexserve.codecs import FRAME_SAMPLES, MODEL_RATE, AudioFormat, make_decoder, make_encoder
from duplexserve.codecs.libopus import LIBOPUS, LibopusStreamEncoder
from duplexserve.codecs.opus import OpusStreamEncoder
from duplexserve.codecs.procpool import CodecProcesses, stat_cpu_seconds
from duplexserve.codecs.resample import StreamResampler

PATHS = [
    AudioFormat("pcm_f32le", 24000),
    AudioFormat("pcm_s16le", 24000),
    AudioFormat("g711_ulaw", 24000),
    AudioFormat("g711_ulaw", 8000),
    AudioFormat("g711_alaw", 8000),
    AudioFormat("pcm_s16le", 16000),
    AudioFormat("pcm_s16le", 44100),
    AudioFormat("pcm_f32le", 48000),
    AudioFormat("pcm_f32le", 96000),
    AudioFormat("pcm_f32le", 192000),
    AudioFormat("opus", 24000),
]


def bench_opus_signals(frames: int = 60) -> dict[str, dict[str, float]]:
    """Opus cost per frame by kind of signal: the encoder's mode, not the code, sets it."""
    signals = {
        "tone mix": speechlike(frames * 0.08),
        "silence": np.zeros(frames * FRAME_SAMPLES, np.float32),
        "noise at -30 dBFS": (0.03 * np.random.default_rng(0).standard_normal(frames * FRAME_SAMPLES)).astype(
            np.float32
        ),
    }
    speech = espeak_speech(frames * 0.08)
    if speech is not None:
        signals["espeak-ng speech"] = speech
    out = {}
    for name, x in signals.items():
        chunks = list(x[: frames * FRAME_SAMPLES].reshape(-1, FRAME_SAMPLES))
        enc, costs, pages = make_encoder(AudioFormat("opus")), [], []
        for f in chunks:
            t0 = time.thread_time()
            pages.append(enc.encode(f))
            costs.append(time.thread_time() - t0)
        dec = make_decoder(AudioFormat("opus"))
        t0 = time.thread_time()
        for page in pages:
            dec.decode(page)
        out[name] = {
            "encode_first_10_frames_us": round(1e6 * statistics.mean(costs[:10]), 1),
            "encode_us": round(1e6 * statistics.mean(costs[12:]), 1),
            "decode_us": round(1e6 * (time.thread_time() - t0) / len(pages), 1),
        }
    return out


def bench_opus_encoders(frames: int = 250, repeats: int = 3) -> dict[str, dict[str, float]]:
    """Ogg/Opus output encoders on speech: sphn's writer against libopus at complexity 0/5/10."""
    x, _ = model_signal(frames * 0.08)
    chunks = list(x[: frames * FRAME_SAMPLES].reshape(-1, FRAME_SAMPLES))
    makers: dict[str, Callable[[], object]] = {"sphn (complexity 10, voip)": OpusStreamEncoder}
    if LIBOPUS is not None:
        for c in (0, 5, 10):
            makers[f"libopus complexity {c}"] = lambda c=c: LibopusStreamEncoder(c)
    out = {}
    for name, make in makers.items():
        best, size = float("inf"), 0
        for _ in range(repeats):
            enc = make()
            enc.encode(chunks[0])  # the headers
            t0 = time.thread_time()
            size = sum(len(enc.encode(f)) for f in chunks[1:])
            best = min(best, (time.thread_time() - t0) / (len(chunks) - 1))
        out[name] = {
            "encode_us": round(1e6 * best, 1),
            "kbit_s": round(8 * size / (0.08 * (len(chunks) - 1)) / 1000, 1),
        }
    return out


def _per_call_us(fn: Callable[[], object], calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of this thread's CPU time per call, in microseconds."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        runs.append((time.thread_time() - t0) / calls * 1e6)
    return statistics.median(runs)


def bench_paths(frames: int = 200) -> list[dict[str, object]]:
    model, _ = model_signal(frames * 0.08)
    model_frames = list(model.reshape(-1, FRAME_SAMPLES))
    rows = []
    for fmt in PATHS:
        # The client's messages in this format, made once with the same codecs.
        client = make_encoder(fmt)
        wire = [client.encode(f) for f in model_frames]
        dec_state = {"dec": make_decoder(fmt), "i": 0}

        def decode_one(state=dec_state, wire=wire, fmt=fmt) -> None:
            if state["i"] == len(wire):  # start the stream over with a fresh decoder
                state["dec"], state["i"] = make_decoder(fmt), 0
            state["dec"].decode(wire[state["i"]])
            state["i"] += 1

        enc_state = {"enc": make_encoder(fmt), "i": 0}

        def encode_one(state=enc_state) -> None:
            state["enc"].encode(model_frames[state["i"] % len(model_frames)])
            state["i"] += 1

        dec, enc = make_decoder(fmt), make_encoder(fmt)
        rows.append(
            {
                "format": fmt.format,
                "sample_rate": fmt.sample_rate,
                "decode_us": round(_per_call_us(decode_one, frames), 1),
                "encode_us": round(_per_call_us(encode_one, frames), 1),
                "inline": bool(dec.inline and enc.inline),
            }
        )
    return rows


def _progress_beside(work: Callable[[], object], seconds: float) -> float:
    """Python steps per second of the main thread while another thread loops ``work``."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            work()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    time.sleep(0.02)
    n, t0 = 0, time.perf_counter()
    end = t0 + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            n += 1
    rate = n / (time.perf_counter() - t0)
    stop.set()
    thread.join()
    return rate


def bench_gil(seconds: float = 0.3, rounds: int = 3) -> dict[str, float]:
    """How much the GIL each codec leaves to other threads: 1.0 like C code that releases
    it (hashing 1 MB), 0.0 like C code that holds it (``sum`` over a range).

    Both references are C calls as busy as a codec and are run interleaved with the codecs,
    so a loaded machine shifts all of them alike: the score compares, it does not time.
    """
    model = speechlike(2.0)
    frames = list(model.reshape(-1, FRAME_SAMPLES))
    x48 = speechlike(0.08, 48000)
    second = speechlike(1.0, 48000)
    rs = StreamResampler(48000, MODEL_RATE)
    opus_enc = make_encoder(AudioFormat("opus"))
    pages = [make_encoder(AudioFormat("opus")).encode(f) for f in frames]
    state = {"dec": make_decoder(AudioFormat("opus")), "i": 0}

    def opus_decode() -> None:
        if state["i"] == len(pages):
            state["dec"], state["i"] = make_decoder(AudioFormat("opus")), 0
        state["dec"].decode(pages[state["i"]])
        state["i"] += 1

    blob = os.urandom(1 << 20)
    works: dict[str, Callable[[], object]] = {
        "releases": lambda: hashlib.sha256(blob).digest(),
        "holds": lambda: sum(range(200_000)),
        "soxr 48k->24k, one 80 ms frame": lambda: rs.process(x48),
        "soxr 48k->24k, 1 s at once": lambda: rs.process(second),
        "sphn opus encode, one frame": lambda: opus_enc.encode(frames[0]),
        "sphn opus decode, one page pair": opus_decode,
    }
    rates: dict[str, list[float]] = {name: [] for name in works}
    for _ in range(rounds):
        for name, work in works.items():
            rates[name].append(_progress_beside(work, seconds))
    med = {name: statistics.median(r) for name, r in rates.items()}
    lo, hi = med["holds"], med["releases"]
    codecs = [name for name in works if name not in ("releases", "holds")]
    return {name: round((med[name] - lo) / (hi - lo), 2) for name in codecs}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bench_hop(calls: int = 20000) -> dict[str, float]:
    async def main() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(2)

        def noop() -> None:
            return None

        await loop.run_in_executor(pool, noop)
        c0, t0 = _cpu(), time.thread_time()

        async def session(n: int) -> None:
            for _ in range(n):
                await loop.run_in_executor(pool, noop)

        await asyncio.gather(*(session(calls // 64) for _ in range(64)))
        done = calls // 64 * 64
        result = {
            "loop_thread_us": round((time.thread_time() - t0) / done * 1e6, 1),
            "process_us": round((_cpu() - c0) / done * 1e6, 1),
        }
        pool.shutdown()
        return result

    return asyncio.run(main())


def bench_opus_offload(sessions: int = 64, frames: int = 40, workers: int = 2) -> list[dict[str, object]]:
    """Each session decodes one client page pair and encodes one model frame per frame."""
    model, _ = model_signal(frames * 0.08)
    model_frames = list(model.reshape(-1, FRAME_SAMPLES))
    client = make_encoder(AudioFormat("opus"))
    pages = [client.encode(f) for f in model_frames]
    fmt = AudioFormat("opus")

    async def run(mode: str) -> dict[str, object]:
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(workers) if mode == "threads" else None
        procs = CodecProcesses(workers) if mode == "processes" else None
        try:
            codecs = [(make_decoder(fmt, procs), make_encoder(fmt, procs)) for _ in range(sessions)]
            if procs is not None:  # let the workers start and import before timing
                await asyncio.gather(*(e.encode_async(model_frames[0]) for _, e in codecs[:workers]))
                codecs = [(make_decoder(fmt, procs), make_encoder(fmt, procs)) for _ in range(sessions)]
            pids = [w.proc.pid for w in procs._workers] if procs is not None else []
            w0 = sum(stat_cpu_seconds(f"/proc/{p}/stat") for p in pids)

            async def session(dec, enc) -> None:
                for i in range(frames):
                    if mode == "processes":
                        await dec.decode_async(pages[i])
                        await enc.encode_async(model_frames[i])
                    elif mode == "threads":
                        await loop.run_in_executor(pool, dec.decode, pages[i])
                        await loop.run_in_executor(pool, enc.encode, model_frames[i])
                    else:
                        dec.decode(pages[i])
                        enc.encode(model_frames[i])
                        await asyncio.sleep(0)

            c0, t0, wall0 = _cpu(), time.thread_time(), time.perf_counter()
            await asyncio.gather(*(session(d, e) for d, e in codecs))
            n = sessions * frames
            wall = time.perf_counter() - wall0
            worker_cpu = sum(stat_cpu_seconds(f"/proc/{p}/stat") for p in pids) - w0
            return {
                "mode": mode,
                "wall_us_per_frame": round(wall / n * 1e6, 1),
                "loop_thread_us_per_frame": round((time.thread_time() - t0) / n * 1e6, 1),
                # One GIL: all of this process's Python and sphn work runs one thread at a time.
                "server_process_cpu_us_per_frame": round((_cpu() - c0) / n * 1e6, 1),
                "worker_processes_cpu_us_per_frame": round(worker_cpu / n * 1e6, 1),
            }
        finally:
            if pool is not None:
                pool.shutdown()
            if procs is not None:
                procs.close()

    return [asyncio.run(run(mode)) for mode in ("inline", "threads", "processes")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--frames", type=int, default=200, help="frames per path measurement")
    parser.add_argument(
        "--opus-encoders",
        action="store_true",
        help="only compare the Ogg/Opus output encoders (sphn, libopus at complexity 0/5/10)",
    )


def run(args: argparse.Namespace) -> int:
    result: dict[str, object] = {"cpu_count": os.cpu_count(), "signal": model_signal(0.08)[1]}
    print(f"signal: {result['signal']}")
    result["opus_encoders"] = encoders = bench_opus_encoders()
    print("Ogg/Opus output encoders (CPU us per 80 ms frame, best of 3; bitrate incl. Ogg pages):")
    for name, row in encoders.items():
        print(f"  {name:28s} {row['encode_us']:7.1f} us  {row['kbit_s']:5.1f} kbit/s")
    if args.opus_encoders:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return 0
    print()
    print(f"{'path':22s} {'decode us/frame':>16s} {'encode us/frame':>16s}  runs")
    result["paths"] = paths = bench_paths(args.frames)
    for row in paths:
        where = "inline" if row["inline"] else "off the loop"
        print(
            f"{row['format'] + '@' + str(row['sample_rate']):22s} {row['decode_us']:16.1f} "
            f"{row['encode_us']:16.1f}  {where}"
        )
    result["opus_signals"] = signals = bench_opus_signals()
    print("\nOpus by signal (us per frame; the encoder's first 10 frames apart):")
    for name, row in signals.items():
        print(
            f"  {name:20s} encode {row['encode_us']:7.1f}  first 10 {row['encode_first_10_frames_us']:7.1f}"
            f"  decode {row['decode_us']:6.1f}"
        )
    result["gil"] = gil = bench_gil()
    print("\nGIL left to other threads (1.0: like C code that releases it, 0.0: like C code that holds it):")
    for name, value in gil.items():
        print(f"  {name:34s} {value:5.2f}")
    result["hop"] = hop = bench_hop()
    print(f"\nthread-pool hop: {hop['loop_thread_us']} us on the loop thread, {hop['process_us']} us in all")
    result["opus_offload"] = rows = bench_opus_offload()
    print("\n64 Opus sessions, decode + encode per frame (us per frame):")
    print(f"  {'mode':10s} {'loop thread':>12s} {'this process':>13s} {'workers':>8s} {'wall':>8s}")
    for row in rows:
        print(
            f"  {row['mode']:10s} {row['loop_thread_us_per_frame']:12.1f} "
            f"{row['server_process_cpu_us_per_frame']:13.1f} "
            f"{row['worker_processes_cpu_us_per_frame']:8.1f} {row['wall_us_per_frame']:8.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0
