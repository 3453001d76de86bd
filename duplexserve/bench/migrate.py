"""``duplexserve bench migrate``: live migration's figures (issue 76, docs/protocol.md "Moved to
another replica").

Two replicas on loopback, the first naming the second in ``--peers``; ``--calls`` paced duplex/1
calls on the first, each sending real-time audio; after ``--before-s`` the first is sent SIGTERM
and its calls move. Each client follows ``session.moved`` (a resume at the second replica, the
fleet's address here) and goes on to the end. Reported: the pause each client heard (from the
last output frame before ``session.moved`` to the first after its resume), p50/p99/max; the time
from SIGTERM to the first replica's exit; how many moved; and whether every output frame came
exactly once (with the synthetic echo: equal to what an unmoved echo answers).

``--engine moshi --preset NAME`` runs it on the moshi engine, both replicas on one GPU
(scripts/bench-moshi-h200.sh, phase migrate-MODEL-N); ``--server-args`` go to both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import websockets
import websockets.asyncio.client

from duplexserve.bench.servers import free_port

FRAME_S = 0.08
SECRET = "bench-migrate-secret"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calls", type=int, default=64, help="live calls on the drained replica")
    p.add_argument("--before-s", type=float, default=3.0, help="audio each call sends before the drain")
    p.add_argument("--after-s", type=float, default=3.0, help="audio each call sends after it")
    p.add_argument("--engine", default="synthetic", choices=("synthetic", "moshi"))
    p.add_argument("--preset", default="", help="moshi engine: --moshi-preset of both replicas")
    p.add_argument("--delay-frames", type=int, default=2, help="synthetic engine: its echo's delay")
    p.add_argument("--server-args", default="", help="more flags for both replicas (one string)")
    p.add_argument("--server-log", default="", help="append both replicas' logs here")
    p.add_argument("--out", default="", help="write the result as one JSON line here")


def frame(seed: int, i: int) -> np.ndarray:
    return np.full(1920, ((seed * 997 + i) % 8000 + 1) / 8192, np.float32)  # distinct, within [-1, 1]


@dataclass
class Call:
    """One paced call that follows a move; arrival times of its output frames."""

    seed: int
    frames: int
    frames_out: list[bytes] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    moved_at: float = 0.0  # when session.moved came (0: it did not)
    resumed_at: float = 0.0
    frames_at_move: int = 0
    closed: dict[str, Any] | None = None
    error: str = ""

    @property
    def pause_s(self) -> float | None:
        """From the last frame before the move to the first after the resume."""
        if not self.moved_at or self.frames_at_move >= len(self.arrivals) or not self.frames_at_move:
            return None
        return self.arrivals[self.frames_at_move] - self.arrivals[self.frames_at_move - 1]

    async def run(self, source: str, fleet: str) -> None:
        url, query = source, ""
        sent, started = 0, time.monotonic()
        while True:
            ws = await websockets.asyncio.client.connect(url + query, compression=None, max_size=None)
            first = json.loads(await ws.recv())
            if first["type"] not in ("session.created", "session.resumed"):
                self.error = str(first)
                return
            if first["type"] == "session.resumed":
                self.resumed_at, sent = time.monotonic(), int(first["frames_in"])
            reader = asyncio.create_task(self._read(ws))
            with contextlib.suppress(websockets.ConnectionClosed):
                while sent < self.frames:
                    due = started + sent * FRAME_S
                    await asyncio.sleep(max(0.0, due - time.monotonic()))
                    await ws.send(frame(self.seed, sent).tobytes())
                    sent += 1
                await ws.send(json.dumps({"type": "input.end"}))
            moved = await reader
            if moved is None:
                return
            url, query = fleet, f"?resume={moved['resume']['token']}&last_frame={len(self.frames_out) - 1}"

    async def _read(self, ws: Any) -> dict[str, Any] | None:
        """Read until the close; the session.moved event if one came."""
        moved = None
        with contextlib.suppress(websockets.ConnectionClosed):
            async for message in ws:
                if isinstance(message, bytes):
                    self.frames_out.append(message)
                    self.arrivals.append(time.monotonic())
                    continue
                event = json.loads(message)
                if event["type"] == "session.moved":
                    moved, self.moved_at, self.frames_at_move = event, time.monotonic(), len(self.frames_out)
                elif event["type"] == "session.closed":
                    self.closed = event
        return moved


def start(port: int, flags: list[str], log: Any) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "duplexserve", "serve", "--port", str(port), "--log-level", "info",
               "--replica-id", str(port), "--peer-url-template", "ws://127.0.0.1:{replica}",
               "--peer-secret", SECRET, *flags]
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600  # a moshi engine loads and compiles
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"replica on {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"replica on {port} did not start")


def quantiles_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    a = np.array(values) * 1000.0
    return {"p50": round(float(np.percentile(a, 50)), 1), "p99": round(float(np.percentile(a, 99)), 1),
            "max": round(float(a.max()), 1)}


def exact(call: Call, delay: int) -> bool:
    """Every output frame once, equal to an unmoved synthetic echo's answer."""
    silence = bytes(1920 * 4)
    want = [silence if i < delay else frame(call.seed, i - delay).tobytes()
            for i in range(call.frames + delay)]
    return call.frames_out == want


def run(args: argparse.Namespace) -> int:
    frames = round((args.before_s + args.after_s) / FRAME_S)
    flags = ["--engine", args.engine, "--resume-grace-s", "30", "--max-sessions", str(args.calls + 8),
             "--max-sessions-per-client", "0", "--max-detached", str(args.calls + 8),
             *(["--moshi-preset", args.preset] if args.preset else []),
             *(["--delay-frames", str(args.delay_frames)] if args.engine == "synthetic" else []),
             *shlex.split(args.server_args)]
    source_port, target_port = free_port(), free_port()
    fd, log_path = tempfile.mkstemp(prefix="bench-migrate-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        target = start(target_port, flags, log)
        source = start(source_port, [*flags, "--peers", str(target_port)], log)
    try:
        result = asyncio.run(measure(args, frames, source, source_port, target_port))
    finally:
        for proc in (source, target):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(60)
            if proc.poll() is None:
                proc.kill()
        with open(log_path, errors="replace") as f:
            text = f.read()
        os.unlink(log_path)
        if args.server_log:
            with open(args.server_log, "a") as f:
                f.write(text)
    drain_lines = [line for line in text.splitlines() if "drain: moved" in line]
    result["drain_log"] = drain_lines[-1].split("INFO ", 1)[-1] if drain_lines else ""
    print(json.dumps(result))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0 if result["moved"] == args.calls and result["exact"] is not False else 1


async def measure(args: argparse.Namespace, frames: int, source: subprocess.Popen[bytes],
                  source_port: int, target_port: int) -> dict[str, Any]:
    src, fleet = f"ws://127.0.0.1:{source_port}/v1/duplex", f"ws://127.0.0.1:{target_port}/v1/duplex"
    calls = [Call(seed, frames) for seed in range(args.calls)]
    tasks = [asyncio.create_task(c.run(src, fleet)) for c in calls]
    await asyncio.sleep(args.before_s)
    drained = time.monotonic()
    source.send_signal(signal.SIGTERM)
    exit_s = await asyncio.to_thread(lambda: (source.wait(120), time.monotonic() - drained)[1])
    await asyncio.wait_for(asyncio.gather(*tasks), args.after_s + 120)
    pauses = [p for c in calls if (p := c.pause_s) is not None]
    return {
        "bench": "migrate", "engine": args.engine, "preset": args.preset, "calls": args.calls,
        "frames": frames, "moved": sum(1 for c in calls if c.moved_at),
        "completed": sum(1 for c in calls if c.closed and c.closed.get("reason") == "completed"),
        "pause_ms": quantiles_ms(pauses),
        "move_ms": quantiles_ms([c.resumed_at - c.moved_at for c in calls if c.moved_at and c.resumed_at]),
        "drain_to_exit_s": round(exit_s, 3),
        "exact": all(exact(c, args.delay_frames) for c in calls) if args.engine == "synthetic" else None,
        "errors": [c.error for c in calls if c.error][:5],
    }
