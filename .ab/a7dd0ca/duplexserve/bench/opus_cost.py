"""What a paced Ogg/Opus session costs the server, per protocol, loop and codec workers apart.

``duplexserve bench opus-cost --sessions 40,200 --protocol native,moshi --seconds 20``

Each level runs paced sessions of espeak-ng speech, one message of two 40 ms Ogg pages per
80 ms frame each way, through the synthetic echo engine: ``native`` is ``/v1/duplex``
with ``input_format=opus&output_format=opus``, ``moshi`` is ``/api/chat`` with a
Kyutai-style client (handshake byte, ``0x01`` + Ogg pages, no JSON), and ``pcm``, the
reference, is the same speech as the model's own float32 frames on ``/v1/duplex`` (no
codec at all): what a frame costs the loop process before any Opus is added to it. The
server's CPU per frame comes from its /metrics, the event-loop process
(``duplexserve_cpu_seconds_total``) and the codec workers
(``duplexserve_codec_processes_cpu_seconds_total``) apart.

A/B: ``--tree NAME=DIR`` (repeatable) runs a server from another checkout (a ``git
archive`` of the commit to compare, say) beside this one; levels then run round-robin,
trees interleaved, ``--rounds`` times, so both see the same minute of a shared machine.
The client parts (pacer, WebSocket client, metrics, the one pre-encoded stream) are
``duplexserve.bench.opus_capacity``'s; a level holds when every guard passes and no frame is
late past a one-frame playback buffer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import time
from dataclasses import dataclass

import numpy as np

from duplexserve.bench import opus_capacity as cap
from duplexserve.bench.servers import serve_tree
from duplexserve.loadgen import metrics as lm
from duplexserve.loadgen.pacer import Pacer
from duplexserve.loadgen.scrape import scrape


def codec_reference_us(messages: list[bytes], complexity: int, frames: int = 100) -> float:
    """libopus's own work per frame now (decode one message, encode one frame, ctypes, one
    thread): the yardstick for the server's figures on a shared machine, whose load
    stretches every CPU time alike. Quiet, it is about 290 us at complexity 5."""
    from duplexserve.codecs.libopus import LibopusStreamEncoder
    from duplexserve.codecs.opus_reader import LibopusStreamDecoder

    dec, enc = LibopusStreamDecoder(), LibopusStreamEncoder(complexity)
    t0 = time.thread_time()
    for m in messages[:frames]:
        enc.encode(dec.decode(m))
    return 1e6 * (time.thread_time() - t0) / min(frames, len(messages))


SWITCHES = "duplexserve_voluntary_context_switches_total"
PATHS = {
    "native": "/v1/duplex?input_format=opus&output_format=opus",
    "moshi": "/api/chat",
    "pcm": "/v1/duplex?input_format=pcm_f32le&output_format=pcm_f32le",
}


@dataclass
class KyutaiSession(cap.OpusSession):
    """Kyutai's client: waits for the handshake, sends ``0x01`` + pages, reads ``0x01`` back."""

    def on_text(self, text: str, now: float) -> None:
        self.events.append({"type": "text", "text": text[:80]})

    def on_binary(self, data: bytes, now: float) -> None:
        kind = data[0] if data else -1
        if kind == 0x00 and self.created is not None and not self.created.done():
            self.created.set_result(None)
        elif kind == 0x01:
            super().on_binary(data[1:], now)
            finished = len(self.received) == len(self.messages)
            if finished and self.done is not None and not self.done.done():
                self.done.set_result(None)
        elif kind == 0x05:
            self.events.append({"type": "error", "code": data[1:].decode(errors="replace")})

    def send_next(self, now: float) -> bool:
        k = len(self.sent)
        assert self.client is not None
        if k == len(self.messages):
            return False
        self.client.send_binary(b"\x01" + self.messages[k])
        self.sent.append(now)
        return True

    def guard(self) -> str | None:
        errors = [e for e in self.events if e.get("type") == "error"]
        if errors:
            return f"error {errors[0].get('code')}"
        if len(self.received) != len(self.messages):
            return f"{len(self.received)} frames back for {len(self.messages)} sent"
        if self.bad_frames:
            return f"{self.bad_frames} frames are not Ogg/Opus pages"
        return None


@dataclass
class PcmSession(cap.OpusSession):
    """The reference: float32 frames both ways, each answer the very bytes sent (echo engine)."""

    def on_binary(self, data: bytes, now: float) -> None:
        k = len(self.received)
        self.received.append(now)
        if k >= len(self.messages) or data != self.messages[k]:
            self.bad_frames += 1

    def guard(self) -> str | None:
        why = super().guard()
        return why.replace("Ogg/Opus pages", "the frames sent") if why else None


def pcm_frames(messages: list[bytes]) -> list[bytes]:
    """The Ogg/Opus stream decoded, as one float32 frame of the model per message."""
    from duplexserve.codecs import FRAME_SAMPLES, AudioFormat, make_decoder

    decoder = make_decoder(AudioFormat("opus"))
    samples = np.concatenate([decoder.decode(m) for m in messages]).astype("<f4")
    n = len(messages)  # as many frames as messages: the decoder's pre-skip is padded back
    samples = np.pad(samples, (0, max(0, n * FRAME_SAMPLES - len(samples))))
    return [samples[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES].tobytes() for i in range(n)]


SESSIONS = {"native": cap.OpusSession, "moshi": KyutaiSession, "pcm": PcmSession}


async def run_level(
    base: str, protocol: str, sessions: int, messages: list[bytes], ramp_s: float, timeout_s: float
) -> dict[str, object]:
    """One level: open every session, pace them, check them, read the server's counters."""
    loop = asyncio.get_running_loop()
    kind = SESSIONS[protocol]
    clients = [kind(messages, keep_audio=(i == 0)) for i in range(sessions)]
    for s in clients:
        s.created, s.done = loop.create_future(), loop.create_future()
    await asyncio.gather(*(cap._open(base + PATHS[protocol], s) for s in clients))
    await asyncio.wait_for(asyncio.gather(*(s.created for s in clients)), timeout_s)
    before = scrape(base + "/")
    pacer = Pacer(lm.FRAME_S)
    start = time.monotonic() + 0.2
    for s in clients:
        pacer.add(start + ramp_s * random.random(), s.send_next)
    done = asyncio.gather(*(s.done for s in clients))
    with contextlib.suppress(TimeoutError):  # the guards say what is missing
        await asyncio.wait_for(done, timeout_s + len(messages) * lm.FRAME_S + ramp_s)
    after = scrape(base + "/")
    for s in clients:
        if s.client is not None:
            s.client.abort()
    await asyncio.sleep(0.5)  # let the server close them before the next level

    failures = [g for g in (s.guard() for s in clients) if g]
    late = [lm.lateness(s.received) for s in clients if s.received]
    trips = np.concatenate([lm.round_trips(s.sent, s.received) for s in clients]) * 1e3
    frames = sum(len(s.received) for s in clients)
    underruns = sum(lm.underruns(x) for x in late)
    result: dict[str, object] = {
        "protocol": protocol,
        "sessions": sessions,
        "frames": frames,
        "guards_ok": not failures,
        "failures": failures[:3],
        "echo_correlation": round(cap._echo_correlation(clients[0]), 3),
        "underruns": underruns,
        "rt_p50_ms": round(lm.percentile(trips, 50), 1) if len(trips) else None,
        "rt_p99_ms": round(lm.percentile(trips, 99), 1) if len(trips) else None,
    }
    if before and after:
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        out = d.get("duplexserve_frames_out_total", 0.0) or 1.0
        loop_us = 1e6 * d["duplexserve_cpu_seconds_total"] / out
        workers_us = 1e6 * d.get("duplexserve_codec_processes_cpu_seconds_total", 0.0) / out
        result.update(
            loop_process_us=round(loop_us, 1),
            workers_us=round(workers_us, 1),
            server_us=round(loop_us + workers_us, 1),
            loop_switches=round(d.get(SWITCHES, 0.0) / out, 2),
        )
    result["held"] = bool(failures == [] and underruns == 0)
    return result


def start_server(tree: str, flags: list[str], cpus: str = "") -> tuple[subprocess.Popen[bytes], str]:
    """A server from the checkout at ``tree`` on a free port; returns it and its base URL."""
    proc, port = serve_tree(tree, ["--max-sessions", "1024", "--idle-timeout-s", "120", *flags], cpus=cpus)
    return proc, f"ws://127.0.0.1:{port}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tree",
        action="append",
        default=[],
        help="NAME=DIR[|FLAGS]: a server from that checkout, with extra flags (default: this one)",
    )
    p.add_argument("--server-flags", default="", help="more flags for every started server")
    p.add_argument("--protocol", default="native,moshi",
                   help="native, moshi and/or pcm (the codec-free reference), comma-separated")
    p.add_argument("--sessions", default="40,120,200", help="levels, comma-separated")
    p.add_argument("--seconds", type=float, default=20.0, help="audio per session")
    p.add_argument("--rounds", type=int, default=1, help="repeat every level this often, trees interleaved")
    p.add_argument("--ramp-s", type=float, default=1.0, help="spread of the session starts")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--complexity", type=int, default=5, help="the servers' --opus-complexity")
    p.add_argument(
        "--server-cpus",
        default="",
        help="pin each server and its codec workers to these cores (taskset list, e.g. 0,1: a "
        "2-core server on a larger host); the client then runs on the others",
    )
    p.add_argument("--json", help="write every result here")


def _cores(spec: str) -> set[int]:
    """A taskset list (``0,1`` or ``0-3,8``) as a set of cores."""
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def run(args: argparse.Namespace) -> int:
    if args.server_cpus:  # the client keeps off the servers' cores
        os.sched_setaffinity(0, os.sched_getaffinity(0) - _cores(args.server_cpus))
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": "."}
    servers = {}
    for name, spec in trees.items():
        tree, _, flags = spec.partition("|")
        flags = f"--opus-complexity {args.complexity} {args.server_flags} {flags}"
        servers[name] = start_server(tree, flags.split(), args.server_cpus)
    opus = cap.opus_stream(args.seconds)
    protocols = args.protocol.split(",")
    streams = {p: pcm_frames(opus) if p == "pcm" else opus for p in protocols}
    results = []
    try:
        for _, base in servers.values():  # warm-up: workers start, code is loaded
            for protocol in protocols:
                asyncio.run(run_level(base, protocol, 2, streams[protocol][:13], 0.1, args.timeout_s))
        for level in (int(x) for x in args.sessions.split(",")):
            for rnd in range(args.rounds):
                for protocol in protocols:
                    for name, (_, base) in servers.items():
                        r = asyncio.run(
                            run_level(base, protocol, level, streams[protocol], args.ramp_s, args.timeout_s)
                        )
                        ref = codec_reference_us(opus, args.complexity)
                        r.update(
                            tree=name,
                            round=rnd,
                            load_average=round(os.getloadavg()[0], 2),
                            codec_reference_us=round(ref, 1),
                        )
                        results.append(r)
                        print(json.dumps(r), flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(15)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "trees": trees,
                    "server_flags": args.server_flags,
                    "seconds": args.seconds,
                    "cpu_count": os.cpu_count(),
                    "levels": results,
                },
                f,
                indent=2,
            )
    return 0
