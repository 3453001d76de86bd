"""Soak: paced sessions that come and go for a set time, then leaks and losses counted.

Keeps ``--concurrency`` paced sessions alive for ``--duration`` seconds; each lasts a
random 2 to 12 s and a tenth of them vanish abruptly (a dropped TCP connection) instead
of ending with ``input.end``. At the end it reports the server's resident memory at the
start and the end (from /metrics), the sessions still holding a slot after everyone
left (leaked), and the frames lost: frames of completed sessions that did not come
back, or came back altered (the echo engine must return the sent bytes).

    duplexserve bench soak --url ws://127.0.0.1:8998/v1/duplex --duration 600
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
import urllib.request
from dataclasses import asdict, dataclass, field

import numpy as np
import websockets.asyncio.client

FRAME_BYTES = 1920 * 4
MESSAGE_FRAMES = 2  # 160 ms messages, as the RTF workload sends


@dataclass
class SoakReport:
    duration_s: float
    concurrency: int
    sessions_completed: int = 0
    sessions_vanished: int = 0
    sessions_failed: int = 0
    frames_sent: int = 0
    frames_lost: int = 0
    frames_altered: int = 0
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0
    rss_peak_mb: float = 0.0
    sessions_leaked: int = 0
    server_frames_dropped: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.frames_lost or self.frames_altered or self.sessions_leaked or self.sessions_failed)


def scrape(http_base: str) -> dict[str, float]:
    with urllib.request.urlopen(http_base + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def paced_session(url: str, frames: int, vanish: bool, seed: int, report: SoakReport) -> None:
    audio = (np.random.default_rng(seed).random(frames * 1920, dtype=np.float32) - 0.5).tobytes()
    step = MESSAGE_FRAMES * FRAME_BYTES
    received: list[bytes] = []
    try:
        async with websockets.asyncio.client.connect(url, compression=None, max_size=None) as ws:
            await ws.recv()

            async def reader() -> None:
                with contextlib.suppress(websockets.ConnectionClosed):
                    async for msg in ws:
                        if isinstance(msg, bytes):
                            received.append(msg)

            reading = asyncio.create_task(reader())
            start = time.monotonic()
            for k, i in enumerate(range(0, len(audio), step)):
                if vanish and k == len(audio) // step // 2:
                    ws.transport.abort()
                    report.sessions_vanished += 1
                    reading.cancel()
                    return
                await asyncio.sleep(max(0.0, start + k * 0.16 - time.monotonic()))  # absolute schedule
                await ws.send(audio[i : i + step])
                report.frames_sent += MESSAGE_FRAMES
            await ws.send(json.dumps({"type": "input.end"}))
            await asyncio.wait_for(reading, 30)
    except Exception as exc:  # every failure is counted and reported
        report.sessions_failed += 1
        report.errors.append(repr(exc)[:200])
        return
    got = b"".join(received)
    expected_frames = frames
    report.frames_lost += max(0, expected_frames - len(received))
    if got != audio[: len(got)]:
        report.frames_altered += 1
    report.sessions_completed += 1


async def soak(url: str, duration_s: float, concurrency: int, seed: int = 0) -> SoakReport:
    http_base = url.replace("ws://", "http://").replace("wss://", "https://").split("/v1/")[0]
    report = SoakReport(duration_s, concurrency)
    first = scrape(http_base)
    report.rss_start_mb = report.rss_peak_mb = first.get("process_resident_memory_bytes", 0) / 2**20
    rng = random.Random(seed)
    deadline = time.monotonic() + duration_s
    counter = 0

    async def worker() -> None:
        nonlocal counter
        while time.monotonic() < deadline:
            counter += 1
            frames = MESSAGE_FRAMES * rng.randint(13, 75)  # 2 to 12 s
            await paced_session(url, frames, rng.random() < 0.1, seed * 100003 + counter, report)

    async def sample_memory() -> None:
        while time.monotonic() < deadline:
            await asyncio.sleep(5)
            rss = scrape(http_base).get("process_resident_memory_bytes", 0) / 2**20
            report.rss_peak_mb = max(report.rss_peak_mb, rss)

    sampler = asyncio.create_task(sample_memory())
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    sampler.cancel()
    await asyncio.sleep(2.0)  # let the server notice the last disconnects
    last = scrape(http_base)
    report.rss_end_mb = last.get("process_resident_memory_bytes", 0) / 2**20
    # A vanished session waits detached for a resume (--resume-grace-s), then expires: not a leak.
    report.sessions_leaked = int(
        last.get("duplexserve_sessions_active", 0) - last.get("duplexserve_sessions_detached", 0)
    )
    report.server_frames_dropped = last.get("duplexserve_frames_dropped_total", 0) - first.get(
        "duplexserve_frames_dropped_total", 0
    )
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="ws://127.0.0.1:8998/v1/duplex")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="write the report here too")


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(soak(args.url, args.duration, args.concurrency, args.seed))
    data = {**asdict(report), "ok": report.ok}
    print(json.dumps(data, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
    return 0 if report.ok else 1
