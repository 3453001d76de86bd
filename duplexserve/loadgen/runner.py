"""Run sessions against a server: warm-up, then the measured phase, over one or more processes.

A :class:`Worker` runs the sessions of one process on one (uvloop) event loop:
``concurrency`` slots each run sessions one after another until the phase's sessions
are used up; paced sessions share one :class:`~duplexserve.loadgen.pacer.Pacer`, burst
sessions connect first and then all send as fast as their sockets take it. With
``processes > 1`` each child process runs a worker over its share and the parent only
coordinates the phases, scrapes the server and shows progress.

Arrivals (``arrivals_per_s``): the same slots, but session lengths chosen so that the
``concurrency`` live sessions turn over at that rate, one joining as one ends: a joining
session lives ``concurrency / arrivals_per_s`` seconds (Little's law), and the first
session of slot k ``(k + 1)`` times that over the slots, so the first ones end one
after another and not all at once. Each session's time to ready (connect to the
protocol's go-ahead: its prompt run) is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import multiprocessing as mp
import queue
import random
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from duplexserve.codecs import AudioFormat
from duplexserve.codecs.formats import SAMPLE_BYTES
from duplexserve.loadgen.audio import FRAME_MS, BaseSignal, SessionAudio, StreamSpec
from duplexserve.loadgen.drivers import get_driver
from duplexserve.loadgen.drivers.native_resume import ResumingNativeDriver
from duplexserve.loadgen.pacer import Pacer
from duplexserve.loadgen.recorder import SessionRecorder, SessionResult
from duplexserve.loadgen.results import ClientStats, RunResult
from duplexserve.loadgen.scrape import cost, scrape

monotonic = time.monotonic
Progress = Callable[[dict[str, Any]], None]


@dataclass
class LoadSpec:
    """Everything one run needs; plain data, so it crosses to child processes."""

    url: str
    protocol: str = "native"
    concurrency: int = 8
    sessions: int = 8
    warmup: int = 0
    frames: int = 50
    message_ms: int = 80
    paced: bool = True
    input_format: str = "pcm_f32le"
    input_rate: int = 24000
    output_format: str = "pcm_f32le"
    output_rate: int = 24000
    wav: str | None = None
    seed: int = 0
    processes: int = 1
    ramp_s: float | None = None  # None: paced sessions start over max(0.1, concurrency / 150) s
    expect: str = "echo"  # echo | silence | none
    delay_frames: int = 0
    playback_buffer_frames: int = 1
    timeout_s: float = 60.0
    label: str = ""
    scrape_metrics: bool = True
    drop_every: float = 0.0  # cut each session's connection about this often (s) and resume; 0: never
    follow_moves: bool = False  # resume where session.moved says the session went (native, PCM)
    text_prompt: str = ""  # every session's persona (PersonaPlex): its text prompt,
    voice_prompt: str = ""  # and the name of a voice prompt the server holds
    arrivals_per_s: float = 0.0  # sessions joining a second, each replacing one that ends; 0: back to back
    loss: float = 0.0  # WebRTC: share of the RTP packets sent that are dropped (a bad network)
    jitter_ms: float = 0.0  # WebRTC: each packet sent held 0 to this long (reordering them)
    opus_complexity: int = 5  # WebRTC: the server's --opus-complexity, its answers replayed with it
    opus_output_fec: bool = False  # WebRTC: the server runs with --webrtc-output-fec
    webrtc_packet_ms: int = 80  # WebRTC: the Opus packets asked of the server (the offer's a=maxptime)

    def stream(self) -> StreamSpec:
        return StreamSpec(
            AudioFormat.parse(self.input_format, self.input_rate),
            AudioFormat.parse(self.output_format, self.output_rate),
            self.frames,
            self.message_ms,
        )

    def prompt(self, index: int = 0) -> dict[str, str]:
        """Session ``index``'s prompt fields: ``{session}`` in the text prompt becomes its number,
        so every session brings a prompt the server has not seen (a prefill, not a cache copy)."""
        text = self.text_prompt.replace("{session}", str(index))
        fields = (("text_prompt", text), ("voice_prompt", self.voice_prompt))
        return {key: value for key, value in fields if value}

    def frames_of(self, slot: int, slots: int, first: bool) -> int:
        """Frames of a session of slot ``slot`` (of ``slots``): ``frames``, or with arrivals the
        length that keeps ``concurrency`` sessions live while ``arrivals_per_s`` join."""
        if not self.arrivals_per_s:
            return self.frames
        life_s = self.concurrency / self.arrivals_per_s
        seconds = (slot + 1) * life_s / slots if first else life_s
        return max(1, round(seconds * 1000 / FRAME_MS))

    def planned_frames(self, sessions: int, concurrency: int) -> int:
        """The answer frames a phase of ``sessions`` run ``concurrency`` at a time expects, in
        all: what the live view's done share and ETA count against."""
        slots = min(concurrency, sessions)
        firsts = sum(self.frames_of(k, slots, True) for k in range(slots))
        return firsts + (sessions - slots) * self.frames_of(0, slots, False)

    def ramp(self) -> float:
        if self.ramp_s is not None:
            return self.ramp_s
        # Handshakes are the dearest messages for client and server: about 150 a second
        # keeps the connection storm from dominating a paced run's latency on one core.
        return max(0.1, self.concurrency / 150.0) if self.paced else 0.0

    def validate(self) -> None:
        if self.concurrency < 1 or self.sessions < 1 or self.warmup < 0 or self.processes < 1:
            raise ValueError("concurrency, sessions and processes must be at least 1, warm-up at least 0")
        if self.frames < 1:
            raise ValueError("a session sends at least one frame")
        if self.expect not in ("echo", "silence", "none"):
            raise ValueError("expect is one of echo, silence, none")
        self.stream()  # formats
        driver = get_driver(self.protocol)
        driver.configure(self)  # the options of one protocol only (--loss, --jitter-ms: WebRTC)
        if self.drop_every < 0:
            raise ValueError("drop_every cannot be negative")
        resuming = self.drop_every or self.follow_moves
        if resuming and (self.protocol != "native" or self.input_format not in SAMPLE_BYTES):
            raise ValueError("--drop-every and --follow-moves need the native protocol and a PCM or G.711 "
                             "input format")
        if self.arrivals_per_s < 0 or (self.arrivals_per_s and not self.paced):
            raise ValueError("--arrivals-per-s is a positive rate of paced sessions")
        if self.prompt() and not driver.takes_prompt:
            raise ValueError(f"the {self.protocol} driver sends no prompt")
        if driver.input_formats is not None and self.input_format not in driver.input_formats:
            raise ValueError(f"{self.protocol} carries only {', '.join(driver.input_formats)}")


@dataclass
class PhaseResult:
    sessions: list[SessionResult]
    cpu_s: float
    wall_s: float
    send_lag: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))


class Worker:
    """The sessions of one process."""

    def __init__(self, spec: LoadSpec, progress: Progress | None = None) -> None:
        self.spec = spec
        self.stream = spec.stream()
        self.base = BaseSignal(spec.frames_of(0, 1, False), spec.wav, spec.seed)  # the longest session
        driver = get_driver(spec.protocol).configure(spec)
        self.driver_cls = ResumingNativeDriver if spec.drop_every or spec.follow_moves else driver
        self.progress = progress
        self.recent: list[float] = []
        self._live: set[SessionRecorder] = set()
        self._done = 0
        self._done_frames = 0
        self._failed = 0
        self._started = monotonic()  # the phase's
        self._rng = random.Random(spec.seed)

    async def run_phase(self, phase: str, indices: list[int], concurrency: int) -> PhaseResult:
        spec = self.spec
        results: list[SessionResult] = []
        if not indices or concurrency < 1:
            return PhaseResult(results, 0.0, 0.0)
        self.pacer = Pacer(spec.message_ms / 1000.0) if spec.paced else None
        self._done = self._done_frames = 0
        slots = min(concurrency, len(indices))
        todo = iter(indices)
        connected = 0
        all_connected = asyncio.get_running_loop().create_future()
        ramp = spec.ramp()

        def on_connected() -> None:
            nonlocal connected
            connected += 1
            if connected >= slots and not all_connected.done():
                all_connected.set_result(None)

        async def slot(k: int) -> None:
            if ramp and k:
                await asyncio.sleep(k * ramp / slots)
            first = True
            for index in todo:
                barrier = all_connected if (first and not spec.paced) else None
                frames = spec.frames_of(k, slots, first)
                results.append(await self._session(index, on_connected if first else None, barrier, frames,
                                                   joined=not first))
                first = False

        usage0, wall0 = _cpu(), monotonic()
        planned = spec.planned_frames(len(indices), slots)
        self._started = monotonic()
        ticker = asyncio.create_task(self._report(phase, len(indices), planned))
        try:
            await asyncio.gather(*(slot(k) for k in range(slots)))
        finally:
            ticker.cancel()
        lag = np.frombuffer(self.pacer.lag, np.float32).copy() if self.pacer else np.zeros(0, np.float32)
        return PhaseResult(results, _cpu() - usage0, monotonic() - wall0, lag)

    async def _session(
        self, index: int, on_connected: Callable[[], None] | None, barrier: asyncio.Future[None] | None,
        frames: int, joined: bool = False,
    ) -> SessionResult:
        spec, stream = self.spec, self.stream
        if frames != stream.frames:
            stream = dataclasses.replace(stream, frames=frames)
        loop = asyncio.get_running_loop()
        rec = SessionRecorder(index, stream.output, spec.expect != "none", self.recent)
        rec.joined = joined
        audio = SessionAudio(self.base, stream, index, spec.expect, spec.delay_frames)
        driver = self.driver_cls(stream.input, stream.output, rec)
        driver.prompt = spec.prompt(index)
        finished: asyncio.Future[None] = loop.create_future()
        dropper: asyncio.Task[None] | None = None
        rec.done_callback = lambda: finished.done() or finished.set_result(None)
        self._live.add(rec)
        try:
            try:
                connecting = monotonic()
                await driver.open(spec.url, spec.timeout_s)
                rec.ready_s = monotonic() - connecting
            except Exception as exc:  # refused, reset, timed out: the session failed, the run goes on
                rec.fail(f"could not open the session: {exc!r}")
                driver.abort()
                if on_connected is not None:
                    on_connected()
                return rec.result(spec.playback_buffer_frames)
            if on_connected is not None:
                on_connected()
            if spec.drop_every:
                dropper = asyncio.create_task(_drops(driver, spec.drop_every, self._rng, rec, spec.timeout_s))
            if barrier is not None:
                await barrier
            if self.pacer is not None:
                sent_all: asyncio.Future[None] = loop.create_future()
                self.pacer.add(
                    monotonic() + self._rng.uniform(0.0, spec.message_ms / 1000.0),
                    _paced_sender(driver, audio, rec, sent_all, spec.expect == "none"),
                )
                await sent_all
                budget = spec.timeout_s
            else:
                await _burst(driver, audio, rec, spec.expect == "none")
                budget = spec.timeout_s + stream.frames * FRAME_MS / 1000
            try:
                await asyncio.wait_for(asyncio.shield(finished), budget)
            except TimeoutError:
                rec.fail(f"no close within {budget:.0f} s after the last message")
                driver.abort()
            return rec.result(spec.playback_buffer_frames)
        finally:
            if dropper is not None:
                dropper.cancel()
            self._live.discard(rec)
            self._done += 1
            self._done_frames += len(rec.received)

    def snapshot(self, phase: str, total: int, planned: int) -> dict[str, Any]:
        recent, self.recent[:] = list(self.recent), []
        return {
            "phase": phase,
            "total": total,
            "planned": planned,
            "elapsed_s": monotonic() - self._started,
            "active": sum(1 for r in self._live if r.session_id),
            "done": self._done,
            "frames": self._done_frames + sum(len(r.received) for r in self._live),
            "recent": recent[-2000:] if len(recent) <= 2000 else random.sample(recent, 2000),
        }

    async def _report(self, phase: str, total: int, planned: int) -> None:
        if self.progress is None:
            return
        while True:
            await asyncio.sleep(0.5)
            self.progress(self.snapshot(phase, total, planned))


def _paced_sender(
    driver: Any, audio: SessionAudio, rec: SessionRecorder, sent_all: asyncio.Future[None], count_only: bool
) -> Callable[[float], bool]:
    """The pacer's callback for one session: send the next message, say whether more follow."""
    messages = audio.messages()
    remaining = audio.spec.messages
    counter = _FrameCounter()

    def send_next(now: float) -> bool:
        nonlocal remaining
        if rec.disconnected:
            sent_all.done() or sent_all.set_result(None)
            return False
        chunk, samples = next(messages)
        expected = audio.expected_after(chunk)
        driver.send_audio(chunk)
        expected = driver.answers(expected)
        frames = counter.count(samples)
        rec.sent_frames(expected, frames if count_only else len(expected), monotonic())
        remaining -= 1
        if remaining:
            return True
        _end(driver, audio, rec)
        sent_all.done() or sent_all.set_result(None)
        return False

    return send_next


async def _drops(driver: Any, every: float, rng: random.Random, rec: SessionRecorder, timeout: float) -> None:
    """Cut the session's connection at random moments, ``every`` seconds apart on average."""
    while True:
        await asyncio.sleep(rng.expovariate(1.0 / every))
        if rec.closed_reason or rec.disconnected or driver.input_ended:
            return  # a session that completed cannot be resumed: drops happen while it streams
        await driver.drop_and_resume(timeout)


def _end(driver: Any, audio: SessionAudio, rec: SessionRecorder) -> None:
    tail = audio.expected_at_end()
    driver.end_input()
    tail = driver.answers(tail)
    rec.sent_frames(tail, len(tail), monotonic())


class _FrameCounter:
    """Whole frames completed by the samples sent so far (when no answer is predicted)."""

    def __init__(self) -> None:
        self.total = 0

    def count(self, samples: int) -> int:
        before = self.total // 1920
        self.total += samples
        return self.total // 1920 - before


async def _burst(driver: Any, audio: SessionAudio, rec: SessionRecorder, count_only: bool) -> None:
    counter = _FrameCounter()
    for n, (chunk, samples) in enumerate(audio.messages()):
        if rec.disconnected:
            return
        expected = audio.expected_after(chunk)
        driver.send_audio(chunk)
        expected = driver.answers(expected)
        frames = counter.count(samples)
        rec.sent_frames(expected, frames if count_only else len(expected), monotonic())
        await driver.drain()
        if n % 8 == 7:
            await asyncio.sleep(0)  # let the other sessions and the receive path run
    _end(driver, audio, rec)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------- coordination
def _share(total: int, parts: int, part: int) -> int:
    return total // parts + (1 if part < total % parts else 0)


def _indices(start: int, total: int, parts: int, part: int) -> list[int]:
    """Session indices of ``part``: interleaved so every process gets a spread of rotations."""
    return list(range(start + part, start + total, parts))


def run_load(spec: LoadSpec, progress: Progress | None = None) -> RunResult:
    """Warm-up (not measured), then the measured phase between two scrapes of /metrics."""
    spec.validate()
    phase = _run_in_process(spec, progress) if spec.processes == 1 else _run_in_children(spec, progress)
    sessions, cpu_s, wall_s, lag, server = phase
    config = asdict(spec)
    client = ClientStats(
        processes=spec.processes,
        cpu_s=cpu_s,
        wall_s=wall_s,
        frames=sum(s.frames_received for s in sessions),
        send_lag=lag,
    )
    return RunResult(spec.label or _label(spec), config, sessions, client, server, spec.warmup)


def _label(spec: LoadSpec) -> str:
    mode = "paced" if spec.paced else "burst"
    length = f"+{spec.arrivals_per_s:g}/s" if spec.arrivals_per_s else f"x {spec.frames} frames"
    return f"{spec.protocol} {mode} c={spec.concurrency} n={spec.sessions} {length}"


def _run_in_process(spec: LoadSpec, progress: Progress | None) -> tuple[Any, ...]:
    import uvloop

    async def main() -> tuple[Any, ...]:
        worker = Worker(spec, progress)
        if spec.warmup:
            await worker.run_phase("warm-up", _indices(spec.sessions, spec.warmup, 1, 0),
                                   min(spec.concurrency, spec.warmup))
        before = scrape(spec.url) if spec.scrape_metrics else None
        result = await worker.run_phase("measure", _indices(0, spec.sessions, 1, 0), spec.concurrency)
        after = scrape(spec.url) if spec.scrape_metrics else None
        return result.sessions, result.cpu_s, result.wall_s, result.send_lag, cost(before, after)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def _child(spec: LoadSpec, part: int, conn: Any, progress_q: Any) -> None:
    """A client process: runs the phases its parent asks for, one at a time."""
    import uvloop

    def report(snapshot: dict[str, Any]) -> None:
        snapshot["part"] = part
        progress_q.put(snapshot)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        worker = Worker(spec, report)
        while True:
            command = conn.recv()
            if command is None:
                return
            phase, indices, concurrency = command
            result = runner.run(worker.run_phase(phase, indices, concurrency))
            conn.send(result)


def _run_in_children(spec: LoadSpec, progress: Progress | None) -> tuple[Any, ...]:
    ctx = mp.get_context("spawn")
    progress_q = ctx.Queue()
    parts = spec.processes
    pipes, procs = [], []
    for part in range(parts):
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(spec, part, child_end, progress_q), daemon=True)
        proc.start()
        pipes.append(parent_end)
        procs.append(proc)
    merged = _Merger(parts, progress)
    try:
        if spec.warmup:
            _phase(pipes, procs, progress_q, merged, "warm-up", spec.sessions, spec.warmup,
                   min(spec.concurrency, spec.warmup))
        before = scrape(spec.url) if spec.scrape_metrics else None
        results = _phase(pipes, procs, progress_q, merged, "measure", 0, spec.sessions, spec.concurrency)
        after = scrape(spec.url) if spec.scrape_metrics else None
    finally:
        for pipe in pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    sessions = sorted((s for r in results for s in r.sessions), key=lambda s: s.index)
    lag = np.concatenate([r.send_lag for r in results]) if results else np.zeros(0, np.float32)
    return (sessions, sum(r.cpu_s for r in results), max(r.wall_s for r in results), lag,
            cost(before, after))


def _phase(pipes: list[Any], procs: list[Any], progress_q: Any, merged: _Merger, phase: str,
           start: int, total: int, concurrency: int) -> list[PhaseResult]:
    parts = len(pipes)
    for part, pipe in enumerate(pipes):
        pipe.send((phase, _indices(start, total, parts, part), _share(concurrency, parts, part)))
    results: dict[int, PhaseResult] = {}
    while len(results) < parts:
        for part, pipe in enumerate(pipes):
            if part not in results and pipe.poll():
                results[part] = pipe.recv()
            elif part not in results and not procs[part].is_alive():
                raise RuntimeError(f"client process {part} died (exit code {procs[part].exitcode})")
        with contextlib.suppress(queue.Empty):
            merged.add(progress_q.get(timeout=0.1))
    return [results[p] for p in range(parts)]


class _Merger:
    """Progress snapshots of several processes summed into one."""

    def __init__(self, parts: int, progress: Progress | None) -> None:
        self.parts = parts
        self.progress = progress
        self.latest: dict[int, dict[str, Any]] = {}
        self.shown = 0.0

    def add(self, snapshot: dict[str, Any]) -> None:
        if self.progress is None:
            return
        self.latest[snapshot["part"]] = snapshot
        now = monotonic()
        if now - self.shown < 0.45:
            return
        self.shown = now
        snaps = list(self.latest.values())
        self.progress({
            "phase": snaps[0]["phase"],
            "total": sum(s["total"] for s in snaps),
            "planned": sum(s["planned"] for s in snaps),
            "elapsed_s": max(s["elapsed_s"] for s in snaps),
            "active": sum(s["active"] for s in snaps),
            "done": sum(s["done"] for s in snaps),
            "frames": sum(s["frames"] for s in snaps),
            "recent": [x for s in snaps for x in s["recent"]],
        })


def recent_p99_ms(recent: list[float]) -> float:
    if not recent:
        return math.nan
    return 1e3 * float(np.percentile(np.asarray(recent), 99))


__all__ = ["LoadSpec", "PhaseResult", "Worker", "recent_p99_ms", "run_load"]
