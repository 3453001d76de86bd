#!/usr/bin/env python3
"""Server CPU per 80 ms frame: WebRTC calls against the WebSocket Opus path, same run.

Starts ``duplexserve serve`` (synthetic echo) pinned to core 0, then from core 1 runs
N WebRTC peers (tests/webrtc_client.py: aiortc, 20 ms Opus packets paced in real time)
for ``--seconds``, then the load generator's Moshi protocol (Ogg/Opus both ways, 80 ms
messages) with the same N and duration, against the same server. For each: the server's
CPU (``duplexserve_cpu_seconds`` plus the codec worker processes') over the run, the
frames it answered, late frames, and CPU per frame. Writes JSON to ``--out``.

    .venv/bin/python scripts/webrtc-cost.py --sessions 10 --seconds 20 --out webrtc-cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def scrape(http: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(http + "/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def server_cpu(m: dict[str, float]) -> float:
    return m["duplexserve_cpu_seconds_total"] + m.get("duplexserve_codec_processes_cpu_seconds_total", 0.0)


async def webrtc_run(http: str, sessions: int, seconds: float) -> dict[str, float]:
    from tests.webrtc_client import Peer

    t = np.arange(int((seconds + 5) * 24000)) / 24000
    signal = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    peers = [Peer(signal) for _ in range(sessions)]
    for peer in peers:
        assert await peer.connect(http) == 201
    await asyncio.sleep(2.0)  # every call connected and streaming
    before, t0 = scrape(http), time.monotonic()
    await asyncio.sleep(seconds)
    after, t1 = scrape(http), time.monotonic()
    for peer in peers:
        await peer.close()
    return measure(before, after, t1 - t0, sessions)


def measure(before: dict[str, float], after: dict[str, float], wall: float, sessions: int) -> dict[str, Any]:
    frames = after["duplexserve_frames_out_total"] - before["duplexserve_frames_out_total"]
    cpu = server_cpu(after) - server_cpu(before)
    return {
        "sessions": sessions, "wall_s": round(wall, 2), "frames": frames,
        "frames_per_session_s": round(frames / wall / sessions, 2),  # 12.5 is real time
        "server_cpu_s": round(cpu, 3), "server_core_share": round(cpu / wall, 3),
        "cpu_us_per_frame": round(1e6 * cpu / max(frames, 1), 1),
        "late_frames": after["duplexserve_frames_late_total"] - before["duplexserve_frames_late_total"],
    }  # fmt: skip


def websocket_run(port: int, sessions: int, seconds: float) -> dict[str, float]:
    http = f"http://127.0.0.1:{port}"
    cmd = ["taskset", "-c", "1", sys.executable, "-m", "duplexserve", "loadgen", f"ws://127.0.0.1:{port}",
           "--protocol", "moshi", "--input-format", "opus", "--output-format", "opus",
           "-c", str(sessions), "-n", str(sessions), "--seconds", str(seconds + 4),
           "--message-ms", "80"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(2.0)
    before, t0 = scrape(http), time.monotonic()
    time.sleep(seconds)
    after, t1 = scrape(http), time.monotonic()
    proc.wait(timeout=120)
    return measure(before, after, t1 - t0, sessions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[10])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--port", type=int, default=8797)
    parser.add_argument("--out", default="webrtc-cost.json")
    args = parser.parse_args()
    server = subprocess.Popen(
        ["taskset", "-c", "0", sys.executable, "-m", "duplexserve", "serve", "--port", str(args.port),
         "--ice-host-addresses", "127.0.0.1", "--log-level", "warning", "--codec-processes", "0"],
    )  # fmt: skip
    try:
        http = f"http://127.0.0.1:{args.port}"
        for _ in range(100):
            try:
                if httpx.get(http + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        os.sched_setaffinity(0, {1})
        results = []
        for n in args.sessions:
            webrtc = asyncio.run(webrtc_run(http, n, args.seconds))
            time.sleep(2)
            ws = websocket_run(args.port, n, args.seconds)
            results.append({"webrtc": webrtc, "websocket_opus": ws})
            print(json.dumps(results[-1]), flush=True)
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "results": results}, f, indent=1)
    finally:
        server.terminate()
        server.wait(timeout=20)


if __name__ == "__main__":
    main()
