"""Benchmarks of the moshi engine (docs/benchmarks.md: "Sessions one H200 holds", `moshi-steps`).

    steps  GPU step time against batch size, engine alone (no server): one step =
           Mimi encode + LMGen step + Mimi decode over every slot, CUDA graphs on; also
           the engine thread's CPU per step, and how late a thread that only sleeps 1 ms
           at a time wakes up meanwhile: the wait an event loop in the same process
           would have for the GIL.
    rtf    paced RTF run through the real server: start it (engine thread or engine
           process), open N sessions that each stream S seconds of audio in 160 ms
           messages on an absolute wall-clock schedule, and report per-session RTF,
           frame round trip, frame lateness, server CPU per frame and the step times;
           ``--runs`` repeats the run and ``--sessions`` may list several counts,
           all on the same server (its slots the largest count), a summary each.
           It prints the ``duplexserve serve`` command it starts, under serve's option
           names (which it takes too: ``--moshi-kv-dtype`` as ``--kv-dtype``).

``duplexserve bench moshi-steps`` and ``duplexserve bench moshi-rtf``
(scripts/bench-moshi-h200.sh runs them on the H200).

This compact paced client stands in for ``duplexserve loadgen`` (built beside it) so
that the H200 run depends on nothing but the server; its metrics follow docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

FRAME_S = 0.08
FRAME = 1920


# --------------------------------------------------------------------------- steps
class GilProbe(threading.Thread):
    """Sleeps 1 ms at a time and records how late it wakes: time spent waiting for the GIL."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.late: list[float] = []
        self.running = True

    def run(self) -> None:
        while self.running:
            t = time.perf_counter()
            time.sleep(0.001)
            self.late.append(time.perf_counter() - t - 0.001)

    def take(self) -> list[float]:
        late, self.late = self.late, []
        return late


def pct(values, q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if len(values) else float("nan")


def _open_live(engine, built: int, live: int) -> np.ndarray:
    """Open every slot, then close all but ``live`` of them, spread over the slots: what
    is left once sessions have ended, the live ones in rows the engine moves down."""
    for slot in range(built):
        engine.open(slot, {})
    keep = np.unique(np.linspace(0, built - 1, live).round().astype(int))
    for slot in np.setdiff1d(np.arange(built), keep).tolist():
        engine.close(slot)
    return keep


def cmd_steps(args: argparse.Namespace) -> None:
    from duplexserve.engine_bridge.moshi.engine import MoshiEngine

    batches = [int(b) for b in args.batches.split(",")]
    lives = [int(n) for n in args.live.split(",")] if args.live else []
    engine = MoshiEngine(
        batches[0], args.preset, device=args.device, context=args.context, kv_dtype=args.kv_dtype,
        compile=args.compile,
    )  # fmt: skip
    t = time.perf_counter()
    engine.start()
    print(f"built {args.preset} in {time.perf_counter() - t:.1f} s", flush=True)
    probe = GilProbe()
    probe.start()
    time.sleep(0.5)
    idle = probe.take()
    rows = []
    cuda = engine.device.type == "cuda"
    for b in batches:
        if b != engine.num_slots:
            engine.resize(b)
        reserved = engine._torch.cuda.memory_reserved() / 2**30 if cuda else 0.0  # every bucket's graphs
        for live in [n for n in lives if n <= b] or [b]:
            slots = _open_live(engine, b, live)
            frames = (np.random.default_rng(0).standard_normal((len(slots), FRAME)) * 0.05).astype(np.float32)
            for _ in range(5):
                engine.step(slots, frames)
            probe.take()
            wall, cpu = [], []
            for _ in range(args.steps):
                t0, c0 = time.perf_counter(), time.thread_time()
                engine.step(slots, frames)
                wall.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
            late = probe.take()
            for slot in slots.tolist():
                engine.close(slot)
            row = {
                "batch": b,
                "live": len(slots),
                "step_ms_p50": 1000 * pct(wall, 50),
                "step_ms_p90": 1000 * pct(wall, 90),
                "engine_thread_cpu_ms_per_step": 1000 * statistics.mean(cpu),
                "host_cpu_us_per_frame": 1e6 * statistics.mean(cpu) / len(slots),
                "gil_wait_ms_p50": 1000 * pct(late, 50),
                "gil_wait_ms_p99": 1000 * pct(late, 99),
                "gil_wait_ms_max": 1000 * max(late),
                "gpu_max_allocated_gib": engine._torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                "gpu_reserved_after_start_gib": reserved,
                # the device's memory in use once started (the rings' part), a slot beyond the ring
                "gpu_in_use_mib": [x / 2**20 for x in engine.memory_in_use],
                "beyond_ring_mib_per_slot": (engine.memory_in_use[0] - engine.memory_in_use[1]) / b / 2**20,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    probe.running = False
    exact = {r["batch"]: r["step_ms_p50"] for r in rows if r["batch"] == r["live"]}
    for r in rows:  # against an engine built for exactly the live count, where measured
        r["vs_built_for_live"] = r["step_ms_p50"] / exact[r["live"]] if r["live"] in exact else None
    result = {
        "preset": args.preset,
        "context": args.context,
        "kv_dtype": args.kv_dtype,
        "compile": args.compile,
        "idle_gil_wait_ms_p99": 1000 * pct(idle, 99),
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'built':>5} {'live':>5} {'step p50':>9} {'p90':>7} {'vs built':>8} {'cpu/step':>9} "
          f"{'cpu/frame':>10}  GIL wait p50/p99/max")  # fmt: skip
    for r in rows:
        ratio = f"{r['vs_built_for_live']:.2f}x" if r["vs_built_for_live"] else "-"
        print(
            f"{r['batch']:>5} {r['live']:>5} {r['step_ms_p50']:>7.1f}ms {r['step_ms_p90']:>5.1f}ms "
            f"{ratio:>8} {r['engine_thread_cpu_ms_per_step']:>7.1f}ms {r['host_cpu_us_per_frame']:>8.0f}us "
            f"{r['gil_wait_ms_p50']:>6.2f}/{r['gil_wait_ms_p99']:.2f}/{r['gil_wait_ms_max']:.1f} ms"
        )


# ----------------------------------------------------------------------------- rtf
def cpu_seconds(pid: int) -> tuple[float, float]:
    """(process itself, its descendants) user + system CPU seconds, read from /proc."""
    from duplexserve.codecs.procpool import stat_cpu_seconds

    def own(p: int) -> float:
        try:
            return stat_cpu_seconds(f"/proc/{p}/stat")
        except OSError:
            return 0.0

    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    rest, stack = 0.0, list(children.get(pid, []))
    while stack:
        p = stack.pop()
        rest += own(p)
        stack.extend(children.get(p, []))
    return own(pid), rest


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def one_session(
    url: str, audio: np.ndarray, start_at: float, message_frames: int, result: dict
) -> None:
    import websockets.asyncio.client

    n = len(audio) // FRAME
    sent = np.zeros(n)
    send_late = np.zeros((n + message_frames - 1) // message_frames)  # past its schedule
    received: list[float] = []
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start_at - loop.time()))
    async with websockets.asyncio.client.connect(url, max_size=None, compression=None) as ws:
        json.loads(await ws.recv())

        async def sender() -> None:
            t0 = loop.time()
            for k, i in enumerate(range(0, n, message_frames)):
                scheduled = t0 + k * message_frames * FRAME_S
                if scheduled > loop.time():
                    await asyncio.sleep(scheduled - loop.time())
                send_late[k] = loop.time() - scheduled
                now = time.perf_counter()
                await ws.send(audio[i * FRAME : (i + message_frames) * FRAME].tobytes())
                sent[i : i + message_frames] = now
            await ws.send(json.dumps({"type": "input.end"}))

        task = asyncio.create_task(sender())
        try:
            async for message in ws:
                if isinstance(message, bytes):
                    received.append(time.perf_counter())
                else:
                    event = json.loads(message)
                    if event["type"] == "error":
                        result["error"] = event
                    elif event["type"] == "session.closed":
                        result["closed"] = event
        except BaseException:  # closed with an error (after its event, if one came)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        await task
    recv = np.array(received[:n])  # the answers to the input; after them, input.end's tail
    result["send_late"] = send_late
    result["frames_in"] = n
    result["frames_out"] = len(recv)
    result["frames_tail"] = len(received) - len(recv)
    if len(recv):
        m = min(n, len(recv))
        result["rtt"] = recv[:m] - sent[:m]
        result["rtf"] = (recv[-1] - sent[0]) / (len(recv) * FRAME_S)
        deadline = recv[0] + FRAME_S * (np.arange(len(recv)) + 1)  # playback buffer of one frame
        result["lateness"] = recv - deadline
        result["late_at"] = recv[result["lateness"] > 0]  # when, on the run's clock


class Timeline(threading.Thread):
    """Scrapes the server's /metrics every ``period_s``: what changed in each interval
    (steps, catch-ups, the mean step, late ticks) shows *when* in the run a tail began."""

    def __init__(self, port: int, period_s: float = 10.0) -> None:
        super().__init__(daemon=True)
        self.port, self.period_s = port, period_s
        self.samples: list[dict[str, float]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.period_s):
            with contextlib.suppress(OSError):
                self.samples.append(scrape(self.port))

    def intervals(self) -> list[dict[str, float]]:
        rows = []
        for a, b in zip(self.samples, self.samples[1:], strict=False):
            d = functools.partial(_difference, a, b)
            steps = d("duplexserve_engine_step_seconds_count")
            step_s = d("duplexserve_engine_step_seconds_sum")
            rows.append({
                "steps": steps,
                "catch_up_steps": d("duplexserve_engine_catchup_steps_total"),
                "step_ms_mean": round(1000 * step_s / steps, 1) if steps else 0,
                "tick_lag_over_20ms": _over(d, "duplexserve_engine_tick_lag_seconds", (20,))["20"],
                "dispatch_over_10ms": _over(d, "duplexserve_answer_dispatch_seconds", (10,))["10"],
            })  # fmt: skip
        return rows


def _difference(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _over(delta: Callable[[str], float], name: str, limits_ms: tuple[int, ...]) -> dict[str, float]:
    """How many observations of histogram ``name`` went over each limit during the run."""
    return {str(ms): delta(f"{name}_count") - delta(f'{name}_bucket{{le="{ms / 1000}"}}') for ms in limits_ms}


def _late_by_time(results: list[dict], bucket_s: float) -> list[int]:
    """Late frames counted by when in its session each was (frame index x 80 ms)."""
    counts: list[int] = []
    for r in results:
        for index in np.flatnonzero(r["lateness"] > 0).tolist():
            b = int(index * FRAME_S // bucket_s)
            counts.extend([0] * (b + 1 - len(counts)))
            counts[b] += 1
    return counts


def _late_by_run_time(results: list[dict], start: float) -> list[int]:
    """Late frames by the second of the run they arrived in: a stall of the server, the
    engine or the client shows as a spike at one moment across sessions."""
    at = np.concatenate([r["late_at"] for r in results]) - start if results else np.zeros(0)
    return np.bincount(at.astype(int)).tolist() if len(at) else []


def _late_from_end(results: list[dict], last: int) -> list[int]:
    """Late frames among each session's last ``last`` frames, the final frame first, then
    all the earlier ones: a tail made at the end of a session shows here."""
    counts = [0] * (last + 1)
    for r in results:
        late = r["lateness"] > 0
        for k in range(last):
            counts[k] += int(len(late) > k and late[-1 - k])
        counts[last] += int(late[: max(0, len(late) - last)].sum())
    return counts


def _late_by_start(results: list[dict], parts: int) -> list[int]:
    """Late frames by when the session opened (its place in the ramp, in ``parts`` groups):
    the last sessions to open stream on while the first ones close."""
    counts = [0] * parts
    for i, r in enumerate(results):
        counts[i * parts // len(results)] += int((r["lateness"] > 0).sum())
    return counts


def _rtt_by_time(results: list[dict], bucket_s: float) -> list[float]:
    """Mean frame round trip (ms) by when in its session each frame was: a step that grows
    with the context shows here, and so does any drift against the first frame."""
    if not results:
        return []
    n = max(len(r["rtt"]) for r in results)
    per = round(bucket_s / FRAME_S)
    rtt = np.full((len(results), n), np.nan)
    for i, r in enumerate(results):
        rtt[i, : len(r["rtt"])] = r["rtt"]
    return [round(1000 * float(np.nanmean(rtt[:, b : b + per])), 1) for b in range(0, n, per)]


async def run_clients(url: str, sessions: int, seconds: float, message_ms: int, ramp_s: float) -> list[dict]:
    audio = (np.random.default_rng(1).standard_normal(int(seconds / FRAME_S) * FRAME) * 0.05).astype(
        np.float32
    )
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.5
    results: list[dict] = [{} for _ in range(sessions)]
    tasks = [
        one_session(url, audio, t0 + ramp_s * i / sessions, message_ms // 80, results[i])
        for i in range(sessions)
    ]
    done = await asyncio.gather(*tasks, return_exceptions=True)
    for r, d in zip(results, done, strict=True):
        if isinstance(d, BaseException):
            r.setdefault("error", repr(d))  # the server's error event, if it sent one
    return results


def mixed_calls(
    live: int, seconds: float, mean_s: float, sigma: float, seed: int
) -> list[tuple[float, float]]:
    """A long-tailed workload of about ``live`` calls at once over ``seconds``: (start, length) of
    each call, lengths lognormal with mean ``mean_s`` (``sigma`` the log's spread: 1.0 puts about
    5% of the calls past 3x the mean), ``live`` of them at the start (spread over 2 s) and then
    Poisson arrivals at ``live / mean_s`` a second, which keep about ``live`` open. A call still
    going at the run's end is cut there (counted in the summary)."""
    rng = np.random.default_rng(seed)
    mu = np.log(mean_s) - sigma**2 / 2  # a lognormal's mean is exp(mu + sigma^2 / 2)
    starts = list(2.0 * np.arange(live) / max(live, 1))
    t = 0.0
    while True:
        t += rng.exponential(mean_s / live)
        if t >= seconds - 1.0:
            break
        starts.append(t)
    lengths = rng.lognormal(mu, sigma, len(starts))
    return [(s, float(max(1.0, min(n, seconds - s)))) for s, n in zip(starts, lengths, strict=True)]


async def run_mixed_clients(url: str, calls: list[tuple[float, float]], message_ms: int) -> list[dict]:
    """``mixed_calls``'s calls, each streaming its length of audio from its start on the run's clock."""
    longest = max(n for _, n in calls)
    noise = np.random.default_rng(1).standard_normal(int(longest / FRAME_S) * FRAME) * 0.05
    audio = noise.astype(np.float32)
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.5
    results: list[dict] = [{} for _ in calls]
    tasks = [
        one_session(url, audio[: int(n / FRAME_S) * FRAME], t0 + start, message_ms // 80, result)
        for (start, n), result in zip(calls, results, strict=True)
    ]
    done = await asyncio.gather(*tasks, return_exceptions=True)
    for r, d in zip(results, done, strict=True):
        if isinstance(d, BaseException):
            r.setdefault("error", repr(d))
    return results


def peak_live(calls: list[tuple[float, float]]) -> int:
    """The most calls open at once."""
    edges = sorted([(s, 1) for s, _ in calls] + [(s + n, -1) for s, n in calls])
    return int(np.max(np.cumsum([d for _, d in edges]))) if edges else 0


#: The engine options moshi-rtf passes on: its own name (``--kv-dtype``) and serve's
#: (``--moshi-kv-dtype``) both set it, the value goes to serve as ``moshi_<name>``.
ENGINE_OPTIONS = (
    "context", "attention", "kv_dtype", "kv_layout", "kv_floor_s", "depformer",
    "mimi_attention", "fp32_matmul", "mimi_graph", "mimi_convs", "compile",
)  # fmt: skip


def serve_arguments(args: argparse.Namespace) -> list[str]:
    """The ``duplexserve serve`` arguments of this run's server: the setup under serve's own
    names, each engine option only where it differs from serve's default, so that the
    printed command reproduces the measured setup and says nothing else."""
    from duplexserve.config import ServerConfig

    defaults = ServerConfig()
    if args.synthetic_step_ms:  # the scheduling alone, no GPU: a full-batch step of fixed cost
        engine = ["--engine", "synthetic", "--step-base-ms", f"{args.synthetic_step_ms:g}"]
    else:
        engine = ["--engine", "moshi", "--moshi-preset", args.preset]
        for name in ENGINE_OPTIONS:
            if getattr(args, name) != getattr(defaults, f"moshi_{name}"):
                engine += [f"--moshi-{name.replace('_', '-')}", str(getattr(args, name))]
    return [
        "serve", *engine, "--max-sessions", str(args.slots or max(args.sessions)),
        *(["--engine-process"] if args.engine_process else []),
        *(["--engine-tick-ms", f"{args.tick_ms:g}"] if args.tick_ms != defaults.engine_tick_ms else []),
        *(["--engine-gather", args.gather] if args.gather != defaults.engine_gather else []),
        *(["--engine-spare", args.spare] if args.spare != defaults.engine_spare else []),
        # Last, what changes nothing measured: the port, the idle timeout.
        *([] if args.synthetic_step_ms or args.warm_rows == defaults.moshi_warm_rows
          else ["--moshi-warm-rows", str(args.warm_rows)]),  # buckets captured after ready: padded steps
        "--port", str(args.port), "--idle-timeout-s", "120",
    ]  # fmt: skip


@contextlib.contextmanager
def started_server(args: argparse.Namespace) -> Iterator[tuple[subprocess.Popen[bytes], float, str]]:
    """The server ``args`` describe, started and ready: (process, seconds to ready, its
    ``duplexserve serve`` command, printed); stopped on leaving."""
    port = args.port
    serve = serve_arguments(args)
    serve_command = shlex.join(["duplexserve", *serve])
    print("serve command:", serve_command, flush=True)
    server_cmd = [sys.executable, "-m", "duplexserve", *serve]
    t = time.perf_counter()
    with open(args.server_log or os.devnull, "w") as log:
        proc = subprocess.Popen(server_cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        yield proc, time.perf_counter() - t, serve_command
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cmd_rtf(args: argparse.Namespace) -> None:
    # a JSON line a run, written as it ends (a cut-off call keeps the runs done)
    with started_server(args) as (proc, startup, serve_command), open(args.out or os.devnull, "w") as out:
        for sessions in args.sessions:  # each count R times, all on this one server
            for _ in range(args.runs):
                summary = _run_once(args, sessions, args.port, proc.pid, startup)
                out.write(json.dumps({**summary, "serve": serve_command}) + "\n")
                out.flush()
                startup = 0.0  # the server's start counts in the first run's line only


def _run_once(args: argparse.Namespace, sessions: int, port: int, pid: int, startup: float) -> dict:
    """One run of ``sessions`` paced sessions against the started server, summarised."""
    before = scrape(port)
    cpu0, cpu0_children = cpu_seconds(pid)
    c0 = time.process_time()
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    timeline = Timeline(port)
    timeline.samples.append(before)
    timeline.start()
    wall0 = time.perf_counter()
    url = f"ws://127.0.0.1:{port}/v1/duplex"
    calls = None
    if args.mixed_mean_s:
        calls = mixed_calls(sessions, args.seconds, args.mixed_mean_s, args.mixed_sigma, args.mixed_seed)
        results = runner(run_mixed_clients(url, calls, args.message_ms))
    else:
        results = runner(run_clients(url, sessions, args.seconds, args.message_ms, 2.0))
    wall = time.perf_counter() - wall0
    timeline.stopped.set()
    client_cpu = time.process_time() - c0
    cpu1, cpu1_children = cpu_seconds(pid)
    after = scrape(port)
    gpu_mem = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        gpu_mem = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    ok = [r for r in results if "rtf" in r]
    frames = sum(r.get("frames_out", 0) for r in results)
    rtfs = sorted(r["rtf"] for r in ok)
    rtt = np.concatenate([r["rtt"] for r in ok]) if ok else np.zeros(1)
    late = np.concatenate([r["lateness"] for r in ok]) if ok else np.zeros(1)
    send_late = np.concatenate([r["send_late"] for r in ok]) if ok else np.zeros(1)
    steps = delta("duplexserve_engine_step_seconds_count")
    summary = {
        "preset": f"synthetic-{args.synthetic_step_ms:g}ms" if args.synthetic_step_ms else args.preset,
        "sessions": sessions,
        "engine": "process" if args.engine_process else "thread",
        "context": args.context or "preset",
        "attention": args.attention,
        "kv_dtype": args.kv_dtype,
        "depformer": args.depformer,
        "mimi_attention": args.mimi_attention,
        "fp32_matmul": args.fp32_matmul,
        "mimi_graph": args.mimi_graph,
        "mimi_convs": args.mimi_convs,
        "tick_ms": args.tick_ms,
        "gather": args.gather,
        "seconds": args.seconds,
        "message_ms": args.message_ms,
        "startup_s": startup,
        "wall_s": wall,
        "complete_sessions": sum(
            1 for r in results if r.get("frames_out") == r.get("frames_in") and "error" not in r
        ),
        "errors": [r["error"] for r in results if "error" in r][:5],
        "rtf_min": rtfs[0] if rtfs else None,
        "rtf_median": statistics.median(rtfs) if rtfs else None,
        "rtf_max": rtfs[-1] if rtfs else None,
        "sessions_rtf_over_1": sum(1 for x in rtfs if x > 1.0),
        "rtt_ms_p50": 1000 * pct(rtt, 50),
        "rtt_ms_p99": 1000 * pct(rtt, 99),
        "rtt_ms_max": 1000 * float(rtt.max()),
        "lateness_ms_p99": 1000 * pct(late, 99),
        "underruns": int((late > 0).sum()),
        "frames": frames,
        "step_ms_mean": 1000 * delta("duplexserve_engine_step_seconds_sum") / steps if steps else None,
        "batch_mean": delta("duplexserve_engine_batch_size_sum") / steps if steps else None,
        "steps": steps,
        "server_cpu_us_per_frame": 1e6 * (cpu1 - cpu0) / max(frames, 1),
        "engine_process_cpu_us_per_frame": 1e6 * (cpu1_children - cpu0_children) / max(frames, 1),
        "server_cpu_cores": (cpu1 - cpu0) / wall,
        "client_cpu_cores": client_cpu / wall,
        "gpu_memory_used": gpu_mem,
        # where the tail comes from: steps that ran long, and when the late frames were
        "steps_over_ms": _over(delta, "duplexserve_engine_step_seconds", (80, 100, 200)),
        "gc_pauses_over_ms": {  # the server process's collector, all generations
            str(ms): sum(
                delta(f'duplexserve_gc_pause_seconds_count{{generation="{g}"}}')
                - delta(f'duplexserve_gc_pause_seconds_bucket{{generation="{g}",le="{ms / 1000}"}}')
                for g in range(3)
            )
            for ms in (20, 50)
        },
        # the server's own view (message received -> frame handed to the socket): late there
        # too, or only at the client?
        "server_turnaround_over_ms": _over(delta, "duplexserve_frame_turnaround_seconds", (150, 200, 300)),
        "server_turnaround_max_ms": max(
            (r["closed"].get("turnaround_ms", {}).get("max", 0.0) for r in ok if "closed" in r), default=None
        ),
        # where else a frame can wait: results for the loop to take them, the loop sending
        "loop_pickup_over_ms": _over(delta, "duplexserve_loop_pickup_seconds", (10, 20, 40)),
        "answer_dispatch_over_ms": _over(delta, "duplexserve_answer_dispatch_seconds", (10, 20, 40)),
        # on the clock: steps for frames that missed their tick, and ticks that started late
        "catch_up_steps": delta("duplexserve_engine_catchup_steps_total"),
        "catch_up_arrival_over_ms": _over(
            delta, "duplexserve_engine_catchup_arrival_seconds", (5, 10, 20, 40)
        ),
        "catch_up_frames": delta("duplexserve_engine_catchup_frames_total"),
        "tick_lag_over_ms": _over(delta, "duplexserve_engine_tick_lag_seconds", (5, 10, 20, 40)),
        "by_10s_of_run": timeline.intervals(),
        # the client's own jitter: messages sent past their schedule
        "client_send_late_ms_p99": 1000 * pct(send_late, 99),
        "client_send_late_ms_max": 1000 * float(send_late.max()),
        "client_sends_late_over_10ms": int((send_late > 0.010).sum()),
        "late_frames_by_10s": _late_by_time(ok, 10.0),
        "late_frames_by_run_s": _late_by_run_time(ok, wall0),
        # late because the client itself sent the message late, not the server
        "late_frames_sent_late_over_10ms": sum(
            int((r["send_late"][np.flatnonzero(r["lateness"] > 0) // (args.message_ms // 80)] > 0.010).sum())
            for r in ok
        ),
        "rtt_ms_mean_by_10s": _rtt_by_time(ok, 10.0),
        "sessions_with_late_frames": sum(1 for r in ok if (r["lateness"] > 0).any()),
        "late_frames_from_end": _late_from_end(ok, 8),
        "late_frames_by_start_order": _late_by_start(ok, 8),
        "kv_layout": args.kv_layout,
        "kv_floor_s": args.kv_floor_s,
        "kv_context_stops": delta("duplexserve_engine_kv_context_stops_total"),
        "sessions_refused": delta("duplexserve_sessions_rejected_total"),
    }
    if calls is not None:  # the long-tailed workload: its calls, and whether every one held
        lengths = np.array([n for _, n in calls])
        summary["mixed"] = {
            "mean_s": args.mixed_mean_s, "sigma": args.mixed_sigma, "seed": args.mixed_seed,
            "calls": len(calls), "slots": args.slots or sessions, "peak_live": peak_live(calls),
            "length_s_p50": pct(lengths, 50), "length_s_p90": pct(lengths, 90),
            "length_s_max": float(lengths.max()),
            "calls_past_4_min": int((lengths > 240).sum()),
            "cut_at_run_end": sum(1 for s, n in calls if s + n >= args.seconds - 1e-6),
        }  # fmt: skip
    print(json.dumps(summary), flush=True)
    return summary


def add_steps_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--preset", "--moshi-preset", default="hibiki-2b-class")
    s.add_argument("--batches", default="1,32,64,96,128,192", help="slot counts the engine is built for")
    s.add_argument(
        "--live",
        default="",
        help="sessions live in each built engine, a comma list (default: all its slots); the "
        "others opened and closed first, so that the live ones are moved down",
    )
    s.add_argument("--steps", type=int, default=50)
    s.add_argument("--device", default="auto")
    s.add_argument("--context", "--moshi-context", type=int, default=0)
    s.add_argument("--kv-dtype", "--moshi-kv-dtype", default="bf16", choices=("bf16", "int8"))
    s.add_argument("--compile", "--moshi-compile", default="off", choices=("on", "off"))
    s.add_argument("--out", default="")


def add_rtf_arguments(r: argparse.ArgumentParser) -> None:
    """Each option that sets up the server also takes serve's name for it (``--moshi-kv-dtype``
    beside ``--kv-dtype``, ``--engine-tick-ms`` beside ``--tick-ms``): a setup reads the same
    in both commands, and the run prints the serve command it starts. Every default is the
    server's (``--moshi-warm-rows`` too: every bucket captured before ready), so that a run
    measures what a server started without options holds."""
    from duplexserve.config import ServerConfig

    r.add_argument("--preset", "--moshi-preset", default="hibiki-2b-class")
    r.add_argument(
        "--sessions",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[64],
        help="sessions of a run, or a comma list: each count's runs in turn on one server of the largest",
    )
    r.add_argument("--seconds", type=float, default=60.0)
    r.add_argument("--message-ms", type=int, default=160)
    r.add_argument("--engine-process", action="store_true")
    r.add_argument("--context", "--moshi-context", type=int, default=0)
    r.add_argument("--attention", "--moshi-attention", default="live", choices=("live", "stock"))
    r.add_argument("--kv-dtype", "--moshi-kv-dtype", default="bf16", choices=("bf16", "int8"))
    r.add_argument(
        "--kv-layout", "--moshi-kv-layout", default=ServerConfig.moshi_kv_layout, choices=("paged", "ring")
    )
    r.add_argument("--kv-floor-s", "--moshi-kv-floor-s", type=float, default=ServerConfig.moshi_kv_floor_s)
    r.add_argument("--depformer", "--moshi-depformer", default="lean", choices=("stock", "lean"))
    r.add_argument("--mimi-attention", "--moshi-mimi-attention", default="live", choices=("live", "stock"))
    r.add_argument("--fp32-matmul", "--moshi-fp32-matmul", default="float32", choices=("float32", "tf32"))
    r.add_argument("--mimi-graph", "--moshi-mimi-graph", default="whole", choices=("parts", "whole"))
    r.add_argument(
        "--mimi-convs", "--moshi-mimi-convs", default="fused", choices=("stock", "fused", "fused-cl")
    )
    r.add_argument("--compile", "--moshi-compile", default="off", choices=("on", "off"))
    r.add_argument(
        "--warm-rows",
        "--moshi-warm-rows",
        type=int,
        default=ServerConfig.moshi_warm_rows,
        help="the server's --moshi-warm-rows (0, its default: every bucket captured before ready)",
    )
    r.add_argument(
        "--tick-ms",
        "--engine-tick-ms",
        type=float,
        default=0.0,
        help="the server's --engine-tick-ms (0, its default: step at once; 80: a clock of one frame)",
    )
    r.add_argument(
        "--gather",
        "--engine-gather",
        default="off",
        choices=("off", "on"),
        help="the server's --engine-gather (off, its default: step at once)",
    )
    r.add_argument(
        "--spare",
        "--engine-spare",
        default="on",
        choices=("off", "on"),
        help="the server's --engine-spare (on, its default: a restart takes a spare engine process)",
    )
    r.add_argument(
        "--synthetic-step-ms",
        type=float,
        default=0.0,
        help="serve the synthetic engine stepping this long whatever the batch (no GPU)",
    )
    r.add_argument(
        "--runs", type=int, default=1, help="runs one after another on one server (a JSON line each in --out)"
    )
    r.add_argument(
        "--slots", type=int, default=0, help="the server's --max-sessions (0: the largest --sessions)"
    )
    r.add_argument(
        "--mixed-mean-s",
        type=float,
        default=0.0,
        help="a long-tailed workload instead of N equal sessions: lognormal call lengths of this mean,"
        " Poisson arrivals keeping about N (--sessions) open over --seconds (0: off)",
    )
    r.add_argument("--mixed-sigma", type=float, default=1.0, help="the lognormal's spread (of the log)")
    r.add_argument("--mixed-seed", type=int, default=0)
    r.add_argument("--port", type=int, default=18990)
    r.add_argument("--server-log", default="")
    r.add_argument("--out", default="")
