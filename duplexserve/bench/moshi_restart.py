"""``duplexserve bench moshi-restart``: how long a GPU serves nobody after its engine dies.

Starts the server as ``moshi-rtf`` does, streams N paced sessions, SIGKILLs the engine
process (the child ``ps`` names ds-engine, the one holding the GPU; not its spare)
``--kill-at`` seconds in, then measures from the kill: when ``/ready``
answers 200 again, and when a new session of one second first completes with every frame
answered. It also counts how the live sessions ended: each must be told (``engine_error``,
docs/protocol.md's restart rule), none may go on silently. A JSON line goes to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import time
import urllib.request

import numpy as np

from duplexserve.bench.moshi import FRAME, add_rtf_arguments, one_session, run_clients, started_server
from duplexserve.engine_bridge.process_engine import ENGINE_NAME


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_rtf_arguments(p)  # the server's defaults: what a restart captures before ready is measured
    p.add_argument("--kill-at", type=float, default=20.0, help="seconds into the run to kill the engine")


def engine_pid(server_pid: int) -> int | None:
    """The server's child named as the engine process (``ps``: ds-engine; not its spare, not
    a codec worker): the process holding the GPU."""
    for pid in _children(server_pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as f:
            if f.read().strip() == ENGINE_NAME:
                return pid
    return None


def _children(pid: int) -> set[int]:
    """Every thread's children: the engine thread, not the main one, spawns the engine."""
    found: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(c) for c in f.read().split())
        except OSError:
            continue
    return found


def _ready(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1)
        return True
    except OSError:
        return False


async def _after_kill(port: int, killed: float, url: str) -> dict[str, float | None]:
    """From the kill: seconds to /ready, and to the first new one-second session complete."""
    loop = asyncio.get_running_loop()
    ready = None
    while time.perf_counter() - killed < 600:
        if await loop.run_in_executor(None, _ready, port):
            ready = time.perf_counter() - killed
            break
        await asyncio.sleep(0.05)
    audio = (np.random.default_rng(2).standard_normal(FRAME * 13) * 0.05).astype(np.float32)
    while time.perf_counter() - killed < 600:
        result: dict = {}
        try:
            await one_session(url, audio, 0.0, 2, result)
        except Exception:  # refused while the engine starts: try again
            result["error"] = "refused"
        if "error" not in result and result.get("frames_out") == result.get("frames_in"):
            return {"ready_s": ready, "session_s": time.perf_counter() - killed}
        await asyncio.sleep(0.1)
    return {"ready_s": ready, "session_s": None}


async def _run(args: argparse.Namespace, server_pid: int) -> dict:
    url = f"ws://127.0.0.1:{args.port}/v1/duplex"
    sessions = max(args.sessions)
    clients = asyncio.create_task(run_clients(url, sessions, args.seconds, args.message_ms, 2.0))
    await asyncio.sleep(args.kill_at)
    pid = engine_pid(server_pid)
    if pid is None:
        raise SystemExit("no engine process to kill (serve it with --engine-process)")
    killed = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    timing = await _after_kill(args.port, killed, url)
    results = await clients
    codes = [
        (r.get("error") or {}).get("code", "?") if isinstance(r.get("error"), dict) else
        ("disconnected" if "error" in r else "completed")
        for r in results
    ]  # fmt: skip
    return {
        "preset": f"synthetic-{args.synthetic_step_ms:g}ms" if args.synthetic_step_ms else args.preset,
        "sessions": sessions, "kv_dtype": args.kv_dtype, "kill_at_s": args.kill_at,
        "engine_pid": pid, **timing,
        "sessions_ended": {code: codes.count(code) for code in sorted(set(codes))},
    }  # fmt: skip


def run(args: argparse.Namespace) -> None:
    with started_server(args) as (proc, startup, serve_command):
        summary = {**asyncio.run(_run(args, proc.pid)), "startup_s": startup, "serve": serve_command}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "a") as out:
            out.write(json.dumps(summary) + "\n")
