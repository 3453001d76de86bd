"""vLLM-Omni's own duplex frontend against duplexserve bridging into the same engine, one run.

``duplexserve bench vllm-side-by-side`` (in a venv with vLLM-Omni 0.30, see
docs/vllm-omni.md). Both servers host the same thing: vLLM-Omni 0.30's real duplex
engine on the CPU with the model stood in by an echo (``testing/vllm_omni_standin``). What
differs is the frontend in front of it:

- ``vllm-omni``: vLLM-Omni's own ``/v1/realtime?duplex=1`` as ``vllm serve`` wires it
  (the real ``api_server`` router, ``OmniDuplexSessionHandler``, ``DuplexOmni``, uvicorn's
  defaults under uvloop); clients send base64 ``pcm_f32le`` JSON appends as vLLM-Omni's
  PersonaPlex client does (``loadgen/drivers/vllm_omni.py``) and get base64 ``pcm16``;
- ``duplexserve``: ``duplexserve serve --engine vllm-omni --vllm-omni-standin``; clients
  speak ``duplex/1``, raw ``pcm_f32le`` both ways.

``floor`` feeds the same engine through duplexserve's bridge in process, with no
WebSocket and no protocol: what vLLM-Omni's engine costs before any frontend work.

Each server runs pinned to core 0, the load generator on the others, and the two
alternate inside every repetition. Sessions send one 80 ms frame per message, as fast
as they can (burst) or on the 80 ms clock (paced). The input is a 16-bit WAV, so the
echo through vLLM-Omni's ``pcm16`` encoder comes back bit-exact and the content guard
holds on both sides. Per run: elapsed time, server CPU per frame, voluntary context
switches per frame, executor submissions per frame (the frontend's own, and those
inside vLLM-Omni's session runners, which both share) and the guards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import wave
from pathlib import Path
from typing import Any

FRONTENDS = ("vllm-omni", "duplexserve")
#: Both servers run with uvicorn's WebSocket keepalive pings off. With its default (a ping
#: every 20 s, 20 s to answer) a burst whose backlog takes the server longer than that to
#: work through (64 x 512 frames at about 1 ms of engine CPU a frame, on one core) has the
#: pong wait behind the audio, and every connection is dropped with 1011.
KEEPALIVE = None
PROTOCOL = {"vllm-omni": "vllm_omni", "duplexserve": "native"}
OUTPUT_FORMAT = {"vllm-omni": "pcm_s16le", "duplexserve": "pcm_f32le"}
PATH = {"vllm-omni": "/v1/realtime", "duplexserve": "/v1/duplex"}


# ============================================================== server side
def _usage() -> tuple[float, float]:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime, float(u.ru_nvcsw)


def serve_vllm_omni(port: int, max_sessions: int) -> None:
    """vLLM-Omni's own frontend, as ``vllm serve`` builds it, over the stand-in engine."""
    import uvicorn
    import uvloop
    from fastapi import FastAPI, Response
    from vllm_omni.engine.duplex.events import AudioDelta
    from vllm_omni.entrypoints.duplex.audio_encoding import encode_audio
    from vllm_omni.entrypoints.duplex.serving import OmniDuplexSessionHandler
    from vllm_omni.entrypoints.duplex_omni import DuplexOmni
    from vllm_omni.entrypoints.openai.api_server import router

    from duplexserve.testing.vllm_omni_standin import CountingExecutor, StandInDuplexOmniEngine

    counts = {"audio_deltas": 0}

    class StandInDuplexOmni(DuplexOmni):
        def _create_engine(self, **_: Any) -> StandInDuplexOmniEngine:
            return StandInDuplexOmniEngine(duplex_audio_encoder=encode_audio, max_sessions=max_sessions)

        def _route_engine_message(self, msg: object) -> bool:
            event = getattr(msg, "event", None)
            if isinstance(event, AudioDelta):
                counts["audio_deltas"] += 1  # one 80 ms frame each: the frames it sent
            return super()._route_engine_message(msg)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        default_pool = CountingExecutor(thread_name_prefix="asyncio")  # asyncio's own default size
        loop.set_default_executor(default_pool)
        # An existing path keeps DuplexOmni from asking a hub for the stand-in's "model".
        omni = StandInDuplexOmni(model=tempfile.mkdtemp(prefix="standin-echo-"))
        app = FastAPI()

        @app.get("/metrics")
        async def metrics() -> Response:
            cpu, vcsw = _usage()
            lines = [
                f"duplexserve_cpu_seconds_total {cpu}",
                f"duplexserve_voluntary_context_switches_total {vcsw}",
                f"duplexserve_executor_submissions_total {default_pool.submissions}",
                f"duplexserve_frames_out_total {counts['audio_deltas']}",
            ]
            return Response("\n".join(lines) + "\n", media_type="text/plain")

        @app.get("/bench/stats")
        async def stats() -> dict[str, Any]:
            return {"engine_executor_submissions": omni.engine.engine_executor_submissions}

        app.include_router(router)
        app.state.openai_serving_duplex = OmniDuplexSessionHandler(duplex_omni=omni)
        app.state.api_server_count = 1
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
            ws_ping_interval=KEEPALIVE,
        )
        try:
            await uvicorn.Server(config).serve()
        finally:
            omni.shutdown()

    uvloop.run(main())


def serve_duplexserve(port: int, max_sessions: int) -> None:
    """``duplexserve serve --engine vllm-omni --vllm-omni-standin``, plus one stats route."""
    from duplexserve.config import ServerConfig
    from duplexserve.server.run import DrainingServer, create_app, uvicorn_config

    config = ServerConfig(
        port=port,
        engine="vllm-omni",
        vllm_omni_standin=True,
        max_sessions=max_sessions,
        log_level="warning",
        idle_timeout_s=120.0,
    )
    app = create_app(config)

    @app.http.get("/bench/stats")
    async def stats() -> dict[str, Any]:
        engine = app.orchestrator.bridge.engine
        return {"engine_executor_submissions": engine.engine_executor_submissions if engine else 0}

    server_config = uvicorn_config(config, app)
    server_config.ws_ping_interval = KEEPALIVE
    DrainingServer(server_config, app, config.drain_grace_s).run()


# ============================================================== client side
class Frontend:
    """One server subprocess, pinned to the server core."""

    def __init__(self, name: str, max_sessions: int, pin: bool) -> None:
        from duplexserve.bench.servers import SERVER_CPU, can_pin, free_port

        self.name = name
        self.port = free_port()
        command = [
            sys.executable,
            "-m",
            "duplexserve",
            "bench",
            "vllm-side-by-side",
            "serve",
            "--frontend",
            name,
            "--port",
            str(self.port),
            "--max-sessions",
            str(max_sessions),
        ]
        if pin and can_pin():
            command = ["taskset", "-c", str(SERVER_CPU), *command]
        fd, self.log_path = tempfile.mkstemp(prefix=f"side-by-side-{name}-", suffix=".log")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        with os.fdopen(fd, "wb") as log:  # the child keeps its own handle
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}{PATH[self.name]}"

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return json.loads(r.read()) if path.startswith("/bench") else r.status

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{Path(self.log_path).read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                self.get("/bench/stats")
                if self.name == "vllm-omni" or self.get("/ready") == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)


def write_wav(path: str, frames: int) -> None:
    """The load generator's signal on the 16-bit grid, so a pcm16 round trip is exact."""
    import numpy as np

    from duplexserve.loadgen.audio import generated_signal

    pcm = np.clip(np.rint(generated_signal(frames) * 32768.0), -32768, 32767).astype("<i2")
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(pcm.tobytes())


def one_run(front: Frontend, mode: str, c: int, frames: int, wav: str, label: str) -> dict[str, Any]:
    from duplexserve.loadgen.runner import LoadSpec, run_load

    spec = LoadSpec(
        url=front.url,
        protocol=PROTOCOL[front.name],
        concurrency=c,
        sessions=c,
        frames=frames,
        message_ms=80,
        paced=mode == "paced",
        input_format="pcm_f32le",
        output_format=OUTPUT_FORMAT[front.name],
        wav=wav,
        timeout_s=120.0,
        label=label,
    )
    before = front.get("/bench/stats")["engine_executor_submissions"]
    result = run_load(spec)
    after = front.get("/bench/stats")["engine_executor_submissions"]
    s = result.summary()
    server = s.get("server") or {}
    out_frames = server.get("frames") or s["frames"]
    return {
        "frontend": front.name,
        "mode": mode,
        "sessions": c,
        "label": label,
        "frames": s["frames"],
        "guards_ok": s["guards_ok"],
        "failures": result.failures[:4],
        "elapsed_s": s["makespan_s"],
        "cpu_us_per_frame": server.get("cpu_us_per_frame", math.nan),
        "vcsw_per_frame": server.get("voluntary_switches_per_frame", math.nan),
        "frontend_exec_per_frame": server.get("executor_submissions_per_frame", math.nan),
        "engine_exec_per_frame": (after - before) / out_frames if out_frames else math.nan,
        "rtf_median": s["rtf_median"],
        "rtf_max": s["rtf_max"],
        "rt_p50_ms": s["rt_p50_ms"],
        "rt_p99_ms": s["rt_p99_ms"],
        "underruns": s["underruns"],
    }


def _line(row: dict[str, Any]) -> str:
    guards = "ok" if row["guards_ok"] else row["failures"]
    return (
        f"  {row['label']}: {row['frames']} frames, {row['elapsed_s']:.2f} s, "
        f"{row['cpu_us_per_frame']:.0f} us/frame, {row['vcsw_per_frame']:.3f} vcsw/frame, "
        f"exec/frame {row['frontend_exec_per_frame']:.3f} + {row['engine_exec_per_frame']:.3f}, "
        f"RTF {row['rtf_median']:.2f}, rt p99 {row['rt_p99_ms']:.0f} ms, guards {guards}"
    )


def _median(rows: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rows if not (isinstance(r[key], float) and math.isnan(r[key]))]
    return statistics.median(values) if values else math.nan


def table(rows: list[dict[str, Any]]) -> str:
    """Medians over repetitions, one line per frontend, mode and session count (markdown)."""
    head = (
        "| mode | sessions | frontend | elapsed s | CPU us/frame | vcsw/frame | frontend exec/frame "
        "| engine exec/frame | RTF median (max) | rt p99 ms | guards |"
    )
    lines = [head, "|" + "---|" * 11]
    keys = sorted({(r["mode"], r["sessions"]) for r in rows})
    for mode, c in keys:
        for name in FRONTENDS:
            group = [r for r in rows if (r["mode"], r["sessions"], r["frontend"]) == (mode, c, name)]
            if not group:
                continue
            guards = "held" if all(r["guards_ok"] for r in group) else "FAILED"
            rtf = (
                f"{_median(group, 'rtf_median'):.2f} ({max(r['rtf_max'] for r in group):.2f})"
                if mode == "paced"
                else "-"
            )
            lines.append(
                f"| {mode} | {c} | {name} | {_median(group, 'elapsed_s'):.2f} | "
                f"{_median(group, 'cpu_us_per_frame'):.0f} | {_median(group, 'vcsw_per_frame'):.3f} | "
                f"{_median(group, 'frontend_exec_per_frame'):.3f} | "
                f"{_median(group, 'engine_exec_per_frame'):.3f} | "
                f"{rtf} | {_median(group, 'rt_p99_ms'):.0f} | {guards} ({len(group)} runs) |"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from duplexserve.bench.servers import pin_client

    levels = tuple(int(x) for x in args.levels.split(","))
    modes = tuple(args.modes.split(","))
    pinning = "not pinned" if args.no_pin else pin_client()
    print(
        f"side by side: {', '.join(FRONTENDS)}; levels {levels}; modes {modes}; {args.reps} reps; {pinning}"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wav = str(out / "input-16bit.wav")
    write_wav(wav, max(args.frames, args.paced_frames) + 64)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally below: stop both servers
    fronts = {name: Frontend(name, args.max_sessions, not args.no_pin) for name in FRONTENDS}
    rows: list[dict[str, Any]] = []
    try:
        for front in fronts.values():
            front.wait_ready()
        for front in fronts.values():  # warm-up: imports, first sessions, code paths
            one_run(front, "burst", 8, 64, wav, f"{front.name} warm-up")
        for rep in range(args.reps):
            for mode in modes:
                frames = args.frames if mode == "burst" else args.paced_frames
                for c in levels:
                    order = list(FRONTENDS) if rep % 2 == 0 else list(reversed(FRONTENDS))
                    for name in order:
                        row = one_run(
                            fronts[name], mode, c, frames, wav, f"{name} {mode} c={c} rep {rep + 1}"
                        )
                        rows.append(row)
                        print(_line(row), flush=True)
    finally:
        for front in fronts.values():
            front.stop()
    summary = table(rows)
    print(summary)
    (out / "side_by_side.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1))
    (out / "side_by_side.md").write_text(summary + "\n")
    print(f"wrote {out / 'side_by_side.json'}")
    return 0 if all(r["guards_ok"] for r in rows) else 1


def floor(sessions: int, frames: int) -> dict[str, float]:
    """The engine alone: ``VllmOmniBridge`` fed in process, no WebSocket and no protocol.

    Each session keeps 8 frames in flight (``--inflight-frames``), as duplexserve's
    orchestrator does; the result is the server CPU per frame that vLLM-Omni's engine
    and the bridge cost before any frontend work.
    """
    import numpy as np

    from duplexserve.engine_bridge.vllm_omni.bridge import VllmOmniBridge
    from duplexserve.engine_bridge.vllm_omni.setup import session_payload, standin_builder
    from duplexserve.testing import STANDIN_MODEL

    rng = np.random.default_rng(0)
    pcm = (rng.integers(-16000, 16000, 64 * 1920) / 32768).astype(np.float32).reshape(64, 1920)

    async def go() -> dict[str, float]:
        sent = [0] * sessions
        got = [0] * sessions
        done = asyncio.get_running_loop().create_future()

        def refill(slot: int) -> None:
            while sent[slot] < frames and sent[slot] - got[slot] < 8:
                if not bridge.try_submit((slot, 1, pcm[sent[slot] % 64])):
                    return
                sent[slot] += 1

        def on_outputs(records: list[Any]) -> None:
            for rec in records:
                assert rec.error is None, rec.message
                for slot in rec.slots.tolist():
                    got[slot] += 1
            for slot in range(sessions):
                refill(slot)
            if sum(got) == sessions * frames and not done.done():
                done.set_result(None)

        bridge = VllmOmniBridge(
            standin_builder(sessions, 5, 0.0),
            on_outputs,
            session_payload=session_payload(STANDIN_MODEL, 24000, {}),
            model=STANDIN_MODEL,
        )
        await bridge.start()
        for slot in range(sessions):
            bridge.open(slot, 1, {})
        while any(bridge.session_of(s) is None for s in range(sessions)):
            await asyncio.sleep(0.01)
        cpu0, vcsw0 = _usage()
        t0 = time.monotonic()
        for slot in range(sessions):
            refill(slot)
        await done
        elapsed = time.monotonic() - t0
        cpu1, vcsw1 = _usage()
        engine = bridge.engine.engine_executor_submissions
        await bridge.stop()
        n = sessions * frames
        return {
            "sessions": sessions,
            "frames": n,
            "elapsed_s": elapsed,
            "cpu_us_per_frame": 1e6 * (cpu1 - cpu0) / n,
            "vcsw_per_frame": (vcsw1 - vcsw0) / n,
            "engine_exec_per_frame": engine / n,
        }

    return asyncio.run(go())


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="part")
    s = sub.add_parser("serve", help="one frontend over the stand-in engine (what run starts)")
    s.add_argument("--frontend", choices=FRONTENDS, required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--max-sessions", type=int, default=256)
    r = sub.add_parser("run", help="the side-by-side benchmark (the default)")
    r.add_argument("--levels", default="64,96", help="session counts")
    r.add_argument("--modes", default="burst,paced", help="burst, paced or both")
    r.add_argument("--frames", type=int, default=512, help="frames per session in burst runs")
    r.add_argument("--paced-frames", type=int, default=250, help="frames per session in paced runs (20 s)")
    r.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    r.add_argument("--max-sessions", type=int, default=256)
    r.add_argument("--out", default="bench-out/vllm-omni")
    r.add_argument("--no-pin", action="store_true", help="do not pin server and client to cores")
    f = sub.add_parser("floor", help="the engine alone, fed in process (pin it: taskset -c 0)")
    f.add_argument("--sessions", type=int, default=64)
    f.add_argument("--frames", type=int, default=512)


def main(args: argparse.Namespace) -> int:
    if args.part is None:  # bare ``vllm-side-by-side``: the run with its defaults
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args(["run"])
    if args.part == "floor":
        print(json.dumps(floor(args.sessions, args.frames)))
        return 0
    if args.part == "serve":
        (serve_vllm_omni if args.frontend == "vllm-omni" else serve_duplexserve)(args.port, args.max_sessions)
        return 0
    return run(args)
