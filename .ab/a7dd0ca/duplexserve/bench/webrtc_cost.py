"""WebRTC calls against the WebSocket Opus path: server CPU a frame, and real time held.

``duplexserve bench webrtc-cost --sessions 10,25 --seconds 15``

One server (synthetic echo, ``--ice-host-addresses 127.0.0.1``, ``--server-flags``:
``--codec-processes 0`` unless told otherwise, so every codec runs in the one process
whose CPU is read) pinned to ``--server-cpus``; the load generator on the other cores
(``--processes`` client processes). Each level runs the load generator's ``webrtc``
protocol (aiortc peers, 20 ms Opus packets with FEC on the pacer's schedule, answers
checked byte for byte by replaying the server's Opus) and then its ``moshi`` protocol
(Ogg/Opus both ways, 80 ms messages) with the same sessions, one after the other.

The server's CPU is read from /metrics over a steady window: it opens ``--settle-s``
after every session of the level is live (the DTLS handshakes and the ramp left out)
and lasts ``--seconds``; per output frame, the event-loop process and the codec workers
apart. The loadgen's guards, RTF, round trips and late frames cover the whole run.
A level *holds* when every guard passes and no frame came later than one frame of
playback buffer. ``--loss`` and ``--jitter-ms`` impair the WebRTC peers' packets (then
``--expect none``), and the server's jitter-buffer counters over the window say what
it did with them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
import urllib.request
from typing import Any

from duplexserve.bench.opus_cost import _cores
from duplexserve.bench.servers import serve_tree
from duplexserve.loadgen.runner import LoadSpec, RunResult, run_load
from duplexserve.loadgen.scrape import parse

CPU = "duplexserve_cpu_seconds_total"
CODEC_CPU = "duplexserve_codec_processes_cpu_seconds_total"
FRAMES_OUT = "duplexserve_frames_out_total"
LATE = "duplexserve_frames_late_total"
ACTIVE = "duplexserve_sessions_active"
JITTER = "duplexserve_jitter_packets_total"
#: Offered WebRTC calls a second: a DTLS handshake costs the server a few ms of CPU.
CALLS_PER_S = 20.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout


def scrape(http: str) -> tuple[dict[str, float], dict[str, float]]:
    """The server's counters (labels summed) and the jitter buffer's by event."""
    with urllib.request.urlopen(http + "/metrics", timeout=10) as response:
        text = response.read().decode()
    jitter = {}
    for line in text.splitlines():
        if line.startswith(JITTER + "{"):
            labels, _, value = line.rpartition(" ")
            event = labels.split('event="', 1)[1].split('"', 1)[0]
            jitter[event] = float(value)
    return parse(text), jitter


class Window:
    """The server's counters over the steady part of a run, read from a thread of its own."""

    def __init__(self, http: str, sessions: int, settle_s: float, seconds: float, deadline_s: float) -> None:
        self.http, self.sessions = http, sessions
        self.settle_s, self.seconds, self.deadline_s = settle_s, seconds, deadline_s
        self.result: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._measure, daemon=True)

    def _measure(self) -> None:
        deadline = time.monotonic() + self.deadline_s
        while time.monotonic() < deadline:
            counters, _ = scrape(self.http)
            if counters.get(ACTIVE, 0) >= self.sessions:
                break
            time.sleep(0.2)
        else:
            self.result = {"window": f"never {self.sessions} sessions live"}
            return
        time.sleep(self.settle_s)
        (before, jitter0), t0 = scrape(self.http), time.monotonic()
        time.sleep(self.seconds)
        (after, jitter1), t1 = scrape(self.http), time.monotonic()
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        wall, frames = t1 - t0, d.get(FRAMES_OUT, 0.0)
        loop_s, codec_s = d.get(CPU, 0.0), d.get(CODEC_CPU, 0.0)
        per = 1e6 / frames if frames else math.nan
        self.result = {
            "window_s": round(wall, 2),
            "live_at_end": after.get(ACTIVE, 0.0),
            "frames": frames,
            "frames_per_session_s": round(frames / wall / self.sessions, 2),  # 12.5: real time
            "server_us": round((loop_s + codec_s) * per, 1),
            "loop_process_us": round(loop_s * per, 1),
            "codec_workers_us": round(codec_s * per, 1),
            "server_core_share": round((loop_s + codec_s) / wall, 3),
            "server_late_frames": d.get(LATE, 0.0),
            "jitter": {k: v - jitter0.get(k, 0.0) for k, v in jitter1.items()},
        }


def run_level(
    args: argparse.Namespace, http: str, protocol: str, sessions: int, packet_ms: int = 80
) -> dict[str, Any]:
    """One level of one protocol: the loadgen run, and the server's window inside it."""
    webrtc = protocol == "webrtc"
    ramp = sessions / CALLS_PER_S if webrtc else sessions / 150.0
    frames = math.ceil((ramp + 2 * args.settle_s + args.seconds + 2.0) / 0.08)
    formats = _formats(protocol)
    spec = LoadSpec(
        url=http.replace("http://", "ws://"), protocol=protocol, concurrency=sessions, sessions=sessions,
        frames=frames, message_ms=args.message_ms if webrtc else 80, processes=args.processes,
        ramp_s=ramp, expect=args.expect, timeout_s=args.timeout_s, scrape_metrics=False,
        loss=args.loss if webrtc else 0.0, jitter_ms=args.jitter_ms if webrtc else 0.0,
        opus_complexity=args.complexity, webrtc_packet_ms=packet_ms, **formats,
    )  # fmt: skip
    window = Window(http, sessions, args.settle_s, args.seconds, ramp + args.timeout_s)
    window.thread.start()
    result = run_load(spec)
    window.thread.join(60)
    name = f"webrtc/{packet_ms}" if webrtc else protocol
    return {"protocol": name, "sessions": sessions, **window.result, **_loadgen(result)}


def _formats(protocol: str) -> dict[str, str]:
    """WebRTC: the model's float32 in and out (Opus on the wire); moshi: Ogg/Opus both ways."""
    fmt = "pcm_f32le" if protocol == "webrtc" else "opus"
    return {"input_format": fmt, "output_format": fmt}


def _loadgen(result: RunResult) -> dict[str, Any]:
    s = result.summary()
    client = s["client"]
    return {
        "guards_ok": s["guards_ok"],
        "failures": result.failures[:3],
        "rtf_max": round(s["rtf_max"], 3),
        "rt_p50_ms": round(s["rt_p50_ms"], 1),
        "rt_p99_ms": round(s["rt_p99_ms"], 1),
        "underruns": s["underruns"],
        "held": bool(s["guards_ok"] and s["underruns"] == 0),
        "client_us": round(client["cpu_us_per_frame"], 1),
        "client_busy": round(client["busy"], 2),
        "client_send_lag_p99_ms": round(client["send_lag_p99_ms"], 1),
        "client_send_lag_max_ms": round(client["send_lag_max_ms"], 1),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", default="10,25", help="levels, comma-separated")
    p.add_argument("--protocol", default="webrtc,moshi",
                   help="webrtc and/or moshi (the WebSocket Ogg/Opus path), comma-separated")
    p.add_argument("--seconds", type=float, default=15.0, help="the steady window of the server CPU")
    p.add_argument("--settle-s", type=float, default=2.0, help="wait this long after every session is live")
    p.add_argument("--packet-ms", default="80",
                   help="webrtc: the Opus packets the server sends (the peers' a=maxptime), comma-separated: "
                        "20,80 runs both against the same server")
    p.add_argument("--message-ms", type=int, default=20,
                   help="webrtc: audio per pacer tick (20: one packet every 20 ms, as a browser)")
    p.add_argument("--processes", type=int, default=1, help="client processes")
    p.add_argument("--expect", choices=("echo", "none"), default="echo",
                   help="echo: every answer checked byte for byte; none: counted only (needed with --loss)")
    p.add_argument("--loss", type=float, default=0.0, help="webrtc: share of the packets sent dropped")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="webrtc: each packet sent held 0 to this")
    p.add_argument("--complexity", type=int, default=5, help="the server's --opus-complexity")
    p.add_argument("--server-flags", default="--codec-processes 0 --webrtc-jitter-frames 10",
                   help="more flags for the server (a deep jitter buffer: the client's stalls on a shared "
                        "machine would be concealed, which fails the exact-answer guard; no CPU changes)")
    p.add_argument("--server-cpus", default="0",
                   help="pin the server (and its codec workers) to these cores; the client on the others")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--tree", action="append", default=[],
                   help="NAME=DIR: a server from that checkout (repeatable: an A/B, levels interleaved); "
                        "default this one")
    p.add_argument("--rounds", type=int, default=1, help="repeat every level this often, trees interleaved")
    p.add_argument("--json", help="write every result here")


def run(args: argparse.Namespace) -> int:
    cores = _cores(args.server_cpus) if args.server_cpus else set()
    if cores and len(os.sched_getaffinity(0) - cores) >= 1:
        os.sched_setaffinity(0, os.sched_getaffinity(0) - cores)  # the client keeps off them
    flags = ["--ice-host-addresses", "127.0.0.1", "--max-sessions", "1024", "--idle-timeout-s", "120",
             "--opus-complexity", str(args.complexity), *args.server_flags.split()]  # fmt: skip
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": ROOT}
    servers: dict[str, tuple[Any, str]] = {}
    results = []
    try:
        for name, tree in trees.items():
            proc, port = serve_tree(os.path.abspath(tree), flags, cpus=args.server_cpus)
            servers[name] = (proc, f"http://127.0.0.1:{port}")
            for protocol in args.protocol.split(","):  # warm-up: code loaded, workers started
                url = servers[name][1].replace("http://", "ws://")
                run_load(LoadSpec(url=url, protocol=protocol, concurrency=2, sessions=2, frames=13,
                                  scrape_metrics=False, expect="none", **_formats(protocol)))  # fmt: skip
        variants = [(p, int(ms)) for p in args.protocol.split(",")
                    for ms in (args.packet_ms.split(",") if p == "webrtc" else ["80"])]  # fmt: skip
        for level in (int(x) for x in args.sessions.split(",")):
            for rnd in range(args.rounds):
                for protocol, packet_ms in variants:
                    for name, (_, http) in servers.items():
                        r = run_level(args, http, protocol, level, packet_ms)
                        r.update(tree=name, round=rnd, load_average=round(os.getloadavg()[0], 2))
                        results.append(r)
                        print(json.dumps(r), flush=True)
                        time.sleep(1.0)  # the last calls closed before the next level
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(20)
    _table(results)
    if args.json:
        with open(args.json, "w") as f:
            options = {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | list | None)}
            json.dump({"args": options, "cpu_count": os.cpu_count(), "levels": results}, f, indent=1)
    return 0 if all(r["guards_ok"] for r in results) else 1


def _table(results: list[dict[str, Any]]) -> None:
    print(f"{'tree':<8} {'protocol':<9} {'sessions':>8} {'server us/frame':>16} {'(loop+codec)':>14} "
          f"{'core':>6} {'frames/s/session':>17} {'late':>5} {'held':>5} {'rt p99 ms':>9} {'client':>6}")
    for r in results:
        print(f"{r['tree']:<8} {r['protocol']:<9} {r['sessions']:>8} {r.get('server_us', math.nan):>16} "
              f"{r.get('loop_process_us', math.nan):>7}+{r.get('codec_workers_us', math.nan):<6} "
              f"{r.get('server_core_share', math.nan):>6} {r.get('frames_per_session_s', math.nan):>17} "
              f"{r.get('server_late_frames', math.nan):>5} {r['held']!s:>5} {r['rt_p99_ms']:>9} "
              f"{r['client_busy']:>6}")  # fmt: skip
