"""Honest sessions under attack, against a no-attack baseline in the same run (issue 73).

``duplexserve bench under-attack --sessions 3 --seconds 4 --out under-attack.json``

Starts a server (the echo engine, ``--forwarded-allow-ips 127.0.0.1``: clients are told apart
as a trusted proxy names them), then for each phase (``baseline``, then each attack of
:mod:`duplexserve.bench.attacks`: an HTTP flood from many forwarded clients, a parse flood from
one key holder's many connections, keep-alive slowloris) starts the attack, waits a second,
runs ``--sessions`` honest sessions at real time for ``--seconds`` and opens ``--newcomers``
sessions of other forwarded clients meanwhile (slots are free: ``--max-sessions`` is ample).
Prints and writes per phase the honest frames' round trip (send to echo, p50/p99/max, ms) and
the newcomers refused (and honest sessions refused or failed); the goal: p99 within
``--goal-ms`` of the baseline's, none refused.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import websockets.asyncio.client
import websockets.exceptions

from duplexserve.bench.attacks import ForwardedFlood, ParseFlood, SlowHeads, forwarded_ws
from duplexserve.bench.servers import Server

FRAME_BYTES = 7680  # 80 ms of the echo engine's PCM
KEY = "under-attack-key"


async def honest_session(url: str, frames: int) -> list[float]:
    """One session at real time; each frame's round trip in seconds (send to its echo)."""
    loop = asyncio.get_running_loop()
    audio = os.urandom(FRAME_BYTES * frames)
    async with websockets.asyncio.client.connect(url, compression=None, max_size=None) as ws:
        if json.loads(await ws.recv())["type"] != "session.created":
            raise RuntimeError("an honest session was refused")
        got: list[float] = []
        received = 0

        async def read() -> None:
            nonlocal received
            async for message in ws:
                if isinstance(message, bytes):
                    received += len(message)
                    while len(got) < received // FRAME_BYTES:
                        got.append(loop.time())

        reader = asyncio.create_task(read())
        sent_at = []
        start = loop.time()
        for i in range(frames):
            await asyncio.sleep(max(0.0, start + 0.08 * i - loop.time()))
            sent_at.append(loop.time())
            await ws.send(audio[i * FRAME_BYTES : (i + 1) * FRAME_BYTES])
        await ws.send(json.dumps({"type": "input.end"}))
        await asyncio.wait_for(reader, 60)
    return [at - sent for at, sent in zip(got, sent_at, strict=False)]


async def newcomer(url: str, client: str) -> bool:
    """Whether a new session of forwarded ``client`` was admitted."""
    try:
        async with websockets.asyncio.client.connect(
            url, compression=None, additional_headers={"x-forwarded-for": client}, open_timeout=30
        ) as ws:
            return json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "session.created"
    except (websockets.exceptions.WebSocketException, OSError, TimeoutError):
        return False


async def phase(url: str, sessions: int, frames: int, newcomers: int, tag: str) -> dict[str, Any]:
    async def arrivals() -> list[bool]:
        out = []
        for i in range(newcomers):
            await asyncio.sleep(frames * 0.08 / (newcomers + 1))
            out.append(await newcomer(url, f"198.51.{tag}.{i + 1}"))
        return out

    honest = asyncio.gather(*(honest_session(url, frames) for _ in range(sessions)), return_exceptions=True)
    trips, admitted = await asyncio.gather(honest, arrivals())
    ms = np.array([t for trip in trips if isinstance(trip, list) for t in trip] or [np.nan]) * 1000.0
    return {
        "frames": int(np.isfinite(ms).sum()),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "max_ms": round(float(ms.max()), 2),
        "honest_failed": sum(not isinstance(trip, list) for trip in trips),
        "newcomers": newcomers,
        "newcomers_refused": admitted.count(False),
    }


def _attack(name: str, port: int, args: argparse.Namespace) -> contextlib.AbstractContextManager[Any]:
    if name == "http_flood":
        clients = [f"10.3.0.{c}" for c in range(args.flood_clients)]
        return ForwardedFlood(port, clients, args.flood_clients, f"/v1/models?token={KEY}")
    if name == "parse_flood":
        path = f"/v1/duplex?token={KEY}"
        return ParseFlood([forwarded_ws(port, "203.0.113.9", path) for _ in range(args.parse_connections)])
    if name == "slowloris":
        return SlowHeads(port, args.slow_connections)
    return contextlib.nullcontext()


def _attacker(name: str, port: int, args: argparse.Namespace, stop: Any) -> None:
    with _attack(name, port, args):
        stop.wait()


@contextlib.contextmanager
def attack(name: str, port: int, args: argparse.Namespace) -> Iterator[None]:
    """``name``'s attack from a process of its own: its threads take no GIL from the honest
    sessions measured here."""
    if name == "baseline":
        yield
        return
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    proc = ctx.Process(target=_attacker, args=(name, port, args, stop), daemon=True)
    proc.start()
    try:
        yield
    finally:
        stop.set()
        proc.join(20)
        if proc.is_alive():
            proc.kill()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=3, help="honest live sessions a phase")
    p.add_argument("--seconds", type=float, default=4.0, help="how long each honest session streams")
    p.add_argument("--newcomers", type=int, default=5, help="sessions of new clients opened a phase")
    p.add_argument("--flood-clients", type=int, default=30, help="forwarded clients of the HTTP flood")
    p.add_argument("--parse-connections", type=int, default=40, help="the key holder's connections")
    p.add_argument("--slow-connections", type=int, default=100, help="slowloris connections")
    p.add_argument("--goal-ms", type=float, default=40.0, help="p99 over the baseline's allowed")
    p.add_argument("--server-args", default="", help="more flags for the server (one string)")
    p.add_argument("--out", default="", help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    flags = ["--api-keys", KEY, "--forwarded-allow-ips", "127.0.0.1", "--max-sessions", "128",
             "--max-sessions-per-client", "64", *args.server_args.split()]  # fmt: skip
    server = Server("duplexserve", "duplexserve", flags).start(pin=False)
    frames = max(1, round(args.seconds / 0.08))
    url = f"{server.url}?token={KEY}"
    results: dict[str, Any] = {"command": "duplexserve bench under-attack", "args": vars(args)}
    phases: dict[str, Any] = {}
    try:
        for tag, name in enumerate(("baseline", "http_flood", "parse_flood", "slowloris")):
            with attack(name, server.port, args):
                time.sleep(1.0)
                phases[name] = asyncio.run(phase(url, args.sessions, frames, args.newcomers, str(tag)))
            time.sleep(2.0)  # the loop calms, the costs decay
            print(name, json.dumps(phases[name]), flush=True)
    finally:
        server.stop()
    base = phases["baseline"]["p99_ms"]
    for got in phases.values():
        got["p99_over_baseline_ms"] = round(got["p99_ms"] - base, 2)
        got["goal_met"] = (
            got["p99_over_baseline_ms"] <= args.goal_ms
            and got["newcomers_refused"] == 0
            and got["honest_failed"] == 0
        )
    results["phases"] = phases
    print(json.dumps(results["phases"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0
