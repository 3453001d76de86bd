"""How many real-time Ogg/Opus sessions a server holds, with a client that costs little.

``duplexserve bench opus-capacity --sessions 100,150,200 --seconds 30 [--serve]``

The load generator (``duplexserve loadgen``) encodes every session's input itself and
replays the server's codecs to check each answer byte for byte; for Opus that costs the
client about three Opus operations a frame, more than the server spends, so on a small
machine it measures the client. Here every session sends the same Ogg/Opus stream,
encoded once (each session has its own decoder at the server, so sharing the bytes
shares nothing there), and answers are checked without decoding: one message per
frame, every one an Ogg page pair, the first carrying OpusHead and OpusTags, and the
session closed ``completed`` with nothing dropped. Session 0's answer is also decoded
and compared with what it sent, so the echo is known to be the right audio.

It reuses the load generator's parts and definitions: the callback WebSocket client,
the absolute-schedule pacer, and RTF, lateness and underruns as docs/benchmarks.md
defines them. A level holds when every guard passes and no session has an underrun.
Server CPU per frame is read from /metrics, event-loop process and codec workers apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import time
from dataclasses import dataclass, field

import numpy as np

from duplexserve.bench.servers import Server
from duplexserve.bench.signals import model_signal, speechlike
from duplexserve.codecs import FRAME_SAMPLES, AudioFormat, make_decoder, make_encoder
from duplexserve.loadgen import metrics as lm
from duplexserve.loadgen.pacer import Pacer
from duplexserve.loadgen.scrape import scrape
from duplexserve.loadgen.wsclient import WSClient

monotonic = time.monotonic


@dataclass
class OpusSession:
    """One session's client side: what it sent when, what came back when."""

    messages: list[bytes]
    keep_audio: bool = False
    sent: list[float] = field(default_factory=list)
    received: list[float] = field(default_factory=list)
    audio: list[bytes] = field(default_factory=list)
    bad_frames: int = 0
    events: list[dict] = field(default_factory=list)
    client: WSClient | None = None
    created: asyncio.Future | None = None
    done: asyncio.Future | None = None

    def on_text(self, text: str, now: float) -> None:
        event = json.loads(text)
        if event.get("type") == "text.delta":
            return
        self.events.append(event)
        if event.get("type") == "session.created" and self.created and not self.created.done():
            self.created.set_result(None)

    def on_binary(self, data: bytes, now: float) -> None:
        first = not self.received
        self.received.append(now)
        if not data.startswith(b"OggS") or (first and b"OpusHead" not in data):
            self.bad_frames += 1
        if self.keep_audio:
            self.audio.append(data)

    def on_close(self, code: int | None, reason: str) -> None:
        for fut in (self.created, self.done):
            if fut is not None and not fut.done():
                fut.set_result(None)

    def send_next(self, now: float) -> bool:
        k = len(self.sent)
        assert self.client is not None
        if k == len(self.messages):
            self.client.send_text('{"type": "input.end"}')
            return False
        self.client.send_binary(self.messages[k])
        self.sent.append(now)
        return True

    def guard(self) -> str | None:
        """Why this session's run is invalid, or None."""
        closed = [e for e in self.events if e.get("type") == "session.closed"]
        errors = [e for e in self.events if e.get("type") == "error"]
        if errors:
            return f"error {errors[0].get('code')}"
        if not closed or closed[-1].get("reason") != "completed" or closed[-1].get("frames_dropped"):
            return f"not completed: {closed[-1] if closed else 'no session.closed'}"
        if len(self.received) != len(self.messages):
            return f"{len(self.received)} frames back for {len(self.messages)} sent"
        if self.bad_frames:
            return f"{self.bad_frames} frames are not Ogg/Opus pages"
        return None


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run_level(
    url: str, sessions: int, messages: list[bytes], ramp_s: float, timeout_s: float
) -> dict[str, object]:
    loop = asyncio.get_running_loop()
    query = "?input_format=opus&output_format=opus"
    clients = [OpusSession(messages, keep_audio=(i == 0)) for i in range(sessions)]
    for s in clients:
        s.created, s.done = loop.create_future(), loop.create_future()
    await asyncio.gather(*(_open(url + query, s) for s in clients))
    await asyncio.wait_for(asyncio.gather(*(s.created for s in clients)), timeout_s)
    before, cpu0 = scrape(url), _cpu()
    pacer = Pacer(lm.FRAME_S)
    start = monotonic() + 0.2
    for s in clients:  # spread the starts so the sessions' frames interleave
        pacer.add(start + ramp_s * random.random(), s.send_next)
    await asyncio.wait_for(
        asyncio.gather(*(s.done for s in clients)), timeout_s + len(messages) * lm.FRAME_S + ramp_s
    )
    after, client_cpu = scrape(url), _cpu() - cpu0
    for s in clients:
        if s.client is not None:
            s.client.abort()

    failures = [g for g in (s.guard() for s in clients) if g]
    rtfs = [lm.rtf(s.sent[0], s.received[-1], len(s.received)) for s in clients if s.sent and s.received]
    late = [lm.lateness(s.received) for s in clients]
    trips = np.concatenate([lm.round_trips(s.sent, s.received) for s in clients]) * 1e3
    underruns = sum(lm.underruns(x) for x in late)
    frames = sum(len(s.received) for s in clients)
    result: dict[str, object] = {
        "sessions": sessions,
        "frames": frames,
        "guards_ok": not failures,
        "failures": failures[:5],
        "echo_correlation": round(_echo_correlation(clients[0]), 3),
        "rtf_median": round(float(np.median(rtfs)), 3) if rtfs else None,
        "rtf_max": round(float(np.max(rtfs)), 3) if rtfs else None,
        "underruns": underruns,
        "lateness_p99_ms": round(1e3 * lm.percentile(np.concatenate(late), 99), 1) if frames else None,
        "rt_p50_ms": round(lm.percentile(trips, 50), 1) if frames else None,
        "rt_p99_ms": round(lm.percentile(trips, 99), 1) if frames else None,
        "client_cpu_us_per_frame": round(1e6 * client_cpu / max(frames, 1), 1),
        "send_lag_p99_ms": round(1e3 * lm.percentile(np.asarray(pacer.lag), 99), 1),
    }
    if before and after:
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        out = d.get("duplexserve_frames_out_total", 0.0) or 1.0
        main_cpu = d["duplexserve_cpu_seconds_total"]
        result["server_loop_process_cpu_us_per_frame"] = round(1e6 * main_cpu / out, 1)
        result["server_codec_processes_cpu_us_per_frame"] = round(
            1e6 * d.get("duplexserve_codec_processes_cpu_seconds_total", 0.0) / out, 1
        )
        result["executor_submissions_per_frame"] = round(d["duplexserve_executor_submissions_total"] / out, 2)
    result["held"] = bool(result["guards_ok"] and underruns == 0)
    return result


async def _open(url: str, session: OpusSession) -> None:
    session.client = await WSClient.connect(url, session)


def _echo_correlation(session: OpusSession) -> float:
    """Session 0's answer, decoded, against what it sent, decoded (the echo engine's output)."""
    if len(session.audio) != len(session.messages):
        return float("nan")
    sent = make_decoder(AudioFormat("opus"))
    got = make_decoder(AudioFormat("opus"))
    a = np.concatenate([sent.decode(m) for m in session.messages])
    b = np.concatenate([got.decode(m) for m in session.audio])
    n = len(a) + len(b)
    corr = np.fft.irfft(np.fft.rfft(b, n) * np.conj(np.fft.rfft(a, n)), n)
    lag = int(np.argmax(corr[:4000]))
    m = min(len(a), len(b) - lag)
    return float(np.corrcoef(a[:m], b[lag : lag + m])[0, 1])


def opus_stream(seconds: float, signal: str = "speech") -> list[bytes]:
    """The client's stream: one message per 80 ms frame (two Ogg pages), encoded once.

    Speech (espeak-ng) by default: Opus costs several times more on speech than on the
    steady tones of ``--signal tones`` (libopus's SILK path against its CELT path).
    """
    x = model_signal(seconds)[0] if signal == "speech" else speechlike(seconds)
    x = x[: len(x) // FRAME_SAMPLES * FRAME_SAMPLES]
    enc = make_encoder(AudioFormat("opus"))
    return [enc.encode(f) for f in x.reshape(-1, FRAME_SAMPLES)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="ws://127.0.0.1:8998/v1/duplex")
    p.add_argument("--serve", action="store_true", help="start a server on a free port for the run")
    p.add_argument("--server-flags", default="", help="extra flags for the started server")
    p.add_argument("--sessions", default="50,100,150,200,250", help="levels, comma-separated")
    p.add_argument("--seconds", type=float, default=30.0, help="audio per session")
    p.add_argument("--ramp-s", type=float, default=1.0, help="spread of the session starts")
    p.add_argument(
        "--signal",
        choices=("speech", "tones"),
        default="speech",
        help="what the sessions say: espeak-ng speech, or steady tones (Opus's cheap path)",
    )
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--json", help="write the results here")


def run(args: argparse.Namespace) -> int:
    server = None
    url = args.url
    if args.serve:
        flags = ["--max-sessions", "1024", "--idle-timeout-s", "120", *args.server_flags.split()]
        server = Server("duplexserve", "duplexserve", flags).start(pin=False)
        url = server.url
    messages = opus_stream(args.seconds, args.signal)
    print(f"signal: {model_signal(0.08)[1] if args.signal == 'speech' else 'tone mix'}")
    results = []
    try:
        asyncio.run(run_level(url, 2, messages[:13], 0.1, args.timeout_s))  # warm-up: workers start
        for level in (int(x) for x in args.sessions.split(",")):
            r = asyncio.run(run_level(url, level, messages, args.ramp_s, args.timeout_s))
            r["load_average"] = os.getloadavg()[0]
            results.append(r)
            print(json.dumps(r), flush=True)
    finally:
        if server is not None:
            server.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "url": url,
                    "seconds": args.seconds,
                    "server_flags": args.server_flags,
                    "signal": args.signal,
                    "ramp_s": args.ramp_s,
                    "cpu_count": os.cpu_count(),
                    "levels": results,
                },
                f,
                indent=2,
            )
    held = [r["sessions"] for r in results if r["held"]]
    print(f"held: {held or 'none'}")
    return 0
