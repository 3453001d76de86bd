"""The event loop's cost of handing Opus work to the codec workers, without sockets.

``duplexserve bench opus-handoff --sessions 200 --seconds 10``

Every session, at its own phase of the 80 ms frame clock (as paced clients arrive),
awaits the decode of one Ogg message in a codec worker and then the encode of the
decoded frame, exactly as ``ProtocolAdapter.decode`` / ``ProtocolAdapter.encode`` do. No
WebSocket, no engine: the loop process's CPU time per frame is what the hand-off costs
it (requests, replies, futures, wake-ups), beside the workers' CPU per frame. Run it
under another checkout (``PYTHONPATH=DIR``) to compare; ``--codec-batch-ms`` is the
server's option of that name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import time

import numpy as np

from duplexserve.codecs import AudioFormat, make_decoder, make_encoder
from duplexserve.codecs.procpool import CodecProcesses

FRAME_S = 0.08


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _switches(procs: CodecProcesses) -> tuple[int, int]:
    """Voluntary context switches (wake-ups, in effect) of this process and of the workers."""
    workers = 0
    for worker in procs._workers:
        with open(f"/proc/{worker.proc.pid}/status") as f:
            workers += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt"))
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw, workers


async def session(procs: CodecProcesses, messages: list[bytes], start: float, lag: list[float]) -> int:
    dec = make_decoder(AudioFormat("opus"), procs)
    enc = make_encoder(AudioFormat("opus"), procs)
    loop = asyncio.get_running_loop()
    done = 0
    for k, message in enumerate(messages):
        due = start + k * FRAME_S
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        samples = await dec.decode_async(message)  # type: ignore[attr-defined]
        if len(samples):
            await enc.encode_async(samples)  # type: ignore[attr-defined]
        lag.append(loop.time() - due)
        done += 1
    return done


async def measure(
    sessions: int, messages: list[bytes], workers: int, batch_ms: float | None
) -> dict[str, float]:
    kwargs = {} if batch_ms is None else {"batch_ms": batch_ms}
    procs = CodecProcesses(workers, **kwargs)
    try:
        warm = [asyncio.create_task(session(procs, messages[:3], 0.0, [])) for _ in range(workers)]
        await asyncio.gather(*warm)
        loop = asyncio.get_running_loop()
        lag: list[float] = []
        start = loop.time() + 0.1
        cpu0, workers0, switches0 = _cpu(), procs.cpu_seconds(), _switches(procs)
        counts = await asyncio.gather(
            *(session(procs, messages, start + FRAME_S * random.random(), lag) for _ in range(sessions))
        )
        frames = sum(counts)
        loop_us = 1e6 * (_cpu() - cpu0) / frames
        workers_us = 1e6 * (procs.cpu_seconds() - workers0) / frames
        switches = [(b - a) / frames for a, b in zip(switches0, _switches(procs), strict=True)]
    finally:
        procs.close()
    return {
        "sessions": sessions,
        "frames": frames,
        "loop_process_us": round(loop_us, 1),
        "workers_us": round(workers_us, 1),
        "loop_switches": round(switches[0], 3),
        "worker_switches": round(switches[1], 3),
        "lag_p99_ms": round(1e3 * float(np.percentile(lag, 99)), 1),
        "load_average": round(os.getloadavg()[0], 2),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--codec-batch-ms", type=float, default=None, help="default: the code's own")


def run(args: argparse.Namespace) -> int:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    from duplexserve.bench.opus_capacity import opus_stream

    messages = opus_stream(args.seconds)
    t0 = time.perf_counter()
    result = asyncio.run(measure(args.sessions, messages, args.workers, args.codec_batch_ms))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result), flush=True)
    return 0
