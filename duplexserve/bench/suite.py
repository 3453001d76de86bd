"""``duplexserve bench [burst|ws|rtf|capacity ...]``: the suite of docs/benchmarks.md.

Each benchmark starts the servers it compares (pinned to core 0), runs the load
generator from the other cores, interleaves the variants it compares inside one run
(timings on a shared machine are only comparable within the same minute), prints a
table with the ratios and the targets, and writes JSON and PNG plots into ``--out``.

- ``burst``: host burst, 64 and 96 sessions x 512 frames as fast as they go, engine
  cost zero, side by side: the two floors (bare echoes on uvicorn, duplexserve's own
  stack, and on picows, a callback WebSocket stack: :mod:`duplexserve.bench.floors`),
  duplexserve, and duplexserve with ``--offload-every-frame`` (vLLM-Omni's per-frame
  thread hops), interleaved.
- ``ws``: the same burst through uvicorn's ``websockets-sansio`` and ``websockets``.
- ``rtf``: 64 and 96 paced sessions, 60.96 s of audio in 160 ms messages, 2 x
  concurrency sessions after one warm-up batch, the synthetic engine stepping like
  a 2B-class model on one H200.
- ``capacity``: paced sessions in steps (500 to 2000), both floors and duplexserve at
  each; the largest count whose guards hold with a p99 at most 2x the picows echo's at
  the same count (docs/benchmarks.md; 1.2x the uvicorn echo's where picows is missing).

Each prints the client's own ceiling (its CPU per frame, the most frames/s one client
core drives) so a client-bound run shows as one.

``--short`` runs CI-sized versions of each (seconds, not minutes). Bare
``duplexserve bench`` runs all four; a name picks one, and more names may follow it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

#: The synthetic step model fitted to docs/benchmarks.md's H200 2B-class table
#: (1: 19.5, 32: 26.0, 64: 35.7, 96: 40.6, 128: 42.5, 192: 55.7 ms), least squares.
H200_2B_BASE_MS = 21.0
H200_2B_PER_SESSION_MS = 0.184

NAMES = ("burst", "ws", "rtf", "capacity")


@dataclass
class Scale:
    """Sizes of every benchmark, full or CI-short."""

    burst_levels: tuple[int, ...] = (64, 96)
    burst_frames: int = 512
    reps: int = 3
    rtf_levels: tuple[int, ...] = (64, 96)
    rtf_frames: int = 762  # 60.96 s: the 762 output frames of docs/benchmarks.md's RTF run
    capacity_levels: tuple[int, ...] = (500, 1000, 1500, 2000)
    capacity_steady_s: float = 20.0  # with every session streaming, after the connection ramp


SHORT = Scale(
    burst_levels=(16,),
    burst_frames=64,
    reps=2,
    rtf_levels=(8,),
    rtf_frames=40,
    capacity_levels=(10, 20),
    capacity_steady_s=1.5,
)


#: The suite's options, declared without defaults (:func:`add_options`) and filled in by :func:`run`.
DEFAULTS: dict[str, Any] = {
    "short": False,
    "out": "bench-out",
    "reps": None,
    "capacity": None,
    "capacity_steady_s": None,
    "message_ms": 160,
    "processes": 1,
    "no_pin": False,
    "server_cpu": 0,
    "nice": 0,
    "no_progress": False,
}


def add_options(p: argparse.ArgumentParser) -> None:
    """The suite's options, on ``duplexserve bench`` and on each suite subcommand.

    They are declared with no default, so an option given before the benchmark's name
    is not reset by the subcommand's parser; :func:`run` fills in :data:`DEFAULTS`.
    """
    none = argparse.SUPPRESS
    p.add_argument("--short", action="store_true", default=none, help="CI-sized: seconds instead of minutes")
    p.add_argument("--out", default=none, help="folder for JSON and plots (default bench-out)")
    p.add_argument("--reps", type=int, default=none, help="interleaved repetitions for burst and ws")
    p.add_argument("--capacity", default=none, help="comma list of session counts for the capacity sweep")
    p.add_argument(
        "--capacity-steady-s", type=float, default=none, help="seconds with every session streaming"
    )
    p.add_argument(
        "--message-ms", type=int, default=none, help="message size of the paced benchmarks (default 160)"
    )
    p.add_argument("--processes", type=int, default=none, help="client processes (default 1)")
    p.add_argument(
        "--no-pin", action="store_true", default=none, help="do not pin server and client to cores"
    )
    p.add_argument(
        "--server-cpu",
        type=int,
        default=none,
        help="the core the servers run on (the client gets the others; default 0)",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=none,
        help="scheduling priority of client and servers (e.g. -10 on a busy shared machine; root)",
    )
    p.add_argument("--no-progress", action="store_true", default=none,
                   help="no live view of each run (elapsed, ETA, sessions, frames/s), only the results; "
                        "a terminal shows it, piped output never")


def _name(value: str) -> str:
    """A suite name; checked here, since ``choices`` rejects an empty ``nargs="*"`` on Python 3.11."""
    if value not in (*NAMES, "all"):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(NAMES)}, all)")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """A suite subcommand: its options, and more of the suite's names to run after it."""
    p.add_argument(
        "more",
        nargs="*",
        type=_name,
        metavar="BENCHMARK",
        help=f"more of the suite to run after this one ({', '.join(NAMES)}, all)",
    )
    add_options(p)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from duplexserve.bench.servers import pin_client, raise_priority

    for name, value in DEFAULTS.items():
        vars(args).setdefault(name, value)
    console = Console(width=None if Console().is_terminal else 140)
    scale = SHORT if args.short else Scale()
    if args.reps:
        scale = replace(scale, reps=args.reps)
    if args.capacity:
        scale = replace(scale, capacity_levels=tuple(int(c) for c in args.capacity.split(",")))
    if args.capacity_steady_s:
        scale = replace(scale, capacity_steady_s=args.capacity_steady_s)
    named = [args.benchmark or "all", *getattr(args, "more", [])]
    chosen = NAMES if "all" in named else tuple(dict.fromkeys(named))
    pinning = "not pinned" if args.no_pin else pin_client(args.server_cpu)
    pinning += ", " + raise_priority(args.nice)
    short = " (short)" if args.short else ""
    console.print(f"[bold]duplexserve bench[/] {' '.join(chosen)}{short}: {pinning}")
    bench = Bench(
        console,
        scale,
        Path(args.out),
        not args.no_pin,
        not args.no_progress,
        args.processes,
        args.message_ms,
        args.nice,
    )
    ok = True
    for name in chosen:
        started = time.monotonic()
        ok = getattr(bench, name.replace("-", "_"))() and ok
        console.print(f"[dim]{name} took {time.monotonic() - started:.0f} s[/]")
    return 0 if ok else 1


def _median(values: list[float]) -> float:
    clean = [v for v in values if not math.isnan(v)]
    return statistics.median(clean) if clean else math.nan


def _meets(value: float, bound: float, how: int) -> bool:
    """how: -1 at most, -2 below, 1 at least, 0 equal."""
    if math.isnan(value):
        return False
    return {-1: value <= bound, -2: value < bound, 1: value >= bound, 0: value == bound}[how]


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


class Bench:
    def __init__(
        self,
        console: Any,
        scale: Scale,
        out: Path,
        pin: bool,
        progress: bool,
        processes: int,
        message_ms: int,
        nice: int = 0,
    ) -> None:
        self.console = console
        self.scale = scale
        self.out = out
        self.pin = pin
        self.progress = progress
        self.processes = processes
        self.message_ms = message_ms
        self.nice = nice

    # ------------------------------------------------------------------ helpers
    def _load(self, url: str, label: str, **kw: Any) -> Any:
        from duplexserve.loadgen.report import LiveView
        from duplexserve.loadgen.runner import LoadSpec, run_load

        spec = LoadSpec(url=url, label=label, processes=self.processes, **kw)
        with LiveView(self.console, self.progress) as view:
            return run_load(spec, view.update)

    def _interleaved(
        self, servers: dict[str, Any], levels: tuple[int, ...], make: Callable[[int], dict[str, Any]]
    ) -> dict[str, dict[int, list[Any]]]:
        """Every variant at every level, ``reps`` times, variants alternating within each rep."""
        runs: dict[str, dict[int, list[Any]]] = {name: {c: [] for c in levels} for name in servers}
        for rep in range(self.scale.reps):
            for c in levels:
                order = list(servers) if rep % 2 == 0 else list(reversed(servers))
                for name in order:
                    r = self._load(servers[name].url, f"{name} c={c} rep {rep + 1}", **make(c))
                    runs[name][c].append(r)
                    self._say_run(r)
        return runs

    def _say_run(self, r: Any) -> None:
        s = r.summary()
        server = s.get("server") or {}
        guard = "ok" if s["guards_ok"] else f"[red]GUARD FAILED: {r.failures[:2]}[/]"
        self.console.print(
            f"  {r.label}: {s['frames']} frames, server "
            f"{server.get('cpu_us_per_frame', math.nan):.1f} us/frame, "
            f"{server.get('voluntary_switches_per_frame', math.nan):.3f} vcsw/frame, makespan "
            f"{s['makespan_s']:.2f} s, rt p99 {s['rt_p99_ms']:.1f} ms, underruns {s['underruns']}, "
            f"client {s['client']['cpu_us_per_frame']:.1f} us/frame ({100 * s['client']['busy']:.0f}% busy), "
            f"guards {guard}"
        )

    def _warm(self, *servers: Any) -> None:
        for server in servers:
            self._load(
                server.url, "warm-up", concurrency=8, sessions=8, frames=64, paced=False, scrape_metrics=False
            )

    def _write(self, name: str, payload: dict[str, Any], runs: list[Any]) -> None:
        from duplexserve.loadgen.report import write_json

        path = self.out / f"{name}.json"
        write_json(path, runs, {"benchmark": name, **payload})
        self.console.print(f"wrote {path}")

    def _burst_spec(self, c: int) -> dict[str, Any]:
        return {
            "concurrency": c,
            "sessions": c,
            "frames": self.scale.burst_frames,
            "message_ms": 80,
            "paced": False,
        }

    @staticmethod
    def _costs(runs: list[Any]) -> dict[str, float]:
        """Medians over repetitions of one variant at one level."""

        def med(key: str, server: bool = True) -> float:
            return _median(
                [
                    (r.summary().get("server") or {}).get(key, math.nan) if server else r.summary()[key]
                    for r in runs
                ]
            )

        return {
            "cpu_us_per_frame": med("cpu_us_per_frame"),
            "vcsw_per_frame": med("voluntary_switches_per_frame"),
            "exec_per_frame": med("executor_submissions_per_frame"),
            "makespan_s": med("makespan_s", server=False),
            "wall_us_per_frame": med("us_per_frame_wall", server=False),
            "rt_p99_ms": med("rt_p99_ms", server=False),
            "client_us_per_frame": _median([r.client.cpu_us_per_frame for r in runs]),
            "client_busy": _median([r.client.busy for r in runs]),
            "guards_ok": all(r.guards_ok for r in runs),
        }

    def _print_targets(self, summary: dict[str, Any]) -> None:
        for level, block in summary.items():
            for target, value in block["targets"].items():
                mark = "[green]met[/]" if block["met"][target] else "[red]missed[/]"
                self.console.print(f"  {level} sessions: {target}: {value:.3f} {mark}")

    # ---------------------------------------------------------------- benchmarks
    def burst(self) -> bool:
        """Benchmarks 1 and 4: host burst, both floors vs duplexserve vs the per-frame offload path."""
        from rich.table import Table

        from duplexserve.bench import floors
        from duplexserve.bench.servers import Server, running
        from duplexserve.loadgen import plots

        self.console.rule("host burst, side by side")
        common = ["--text-every", "0", "--max-sessions", "256"]
        servers, note = floors.servers()
        if note:
            self.console.print(f"[yellow]{note}[/]")
        servers |= {
            "duplexserve": Server("duplexserve", "duplexserve", common),
            "offload path": Server("offload path", "duplexserve", [*common, "--offload-every-frame"]),
        }
        levels = self.scale.burst_levels
        with running(*servers.values(), pin=self.pin, nice=self.nice):
            self._warm(*servers.values())
            runs = self._interleaved(servers, levels, self._burst_spec)
        table = Table(title=f"host burst: median of {self.scale.reps} interleaved runs, engine cost zero")
        for col in (
            "variant",
            "sessions x frames",
            "server us/frame",
            "vcsw/frame",
            "exec/frame",
            "makespan s",
            "wall us/frame",
            "client us/frame",
            "guards",
        ):
            table.add_column(col, justify="left" if col == "variant" else "right")
        summary: dict[str, Any] = {}
        lines: list[str] = []
        ok = True
        for c in levels:
            costs = {name: self._costs(runs[name][c]) for name in servers}
            for name, k in costs.items():
                table.add_row(
                    name,
                    f"{c} x {self.scale.burst_frames}",
                    f"{k['cpu_us_per_frame']:.1f}",
                    f"{k['vcsw_per_frame']:.3f}",
                    f"{k['exec_per_frame']:.3f}",
                    f"{k['makespan_s']:.2f}",
                    f"{k['wall_us_per_frame']:.1f}",
                    f"{k['client_us_per_frame']:.1f}",
                    "ok" if k["guards_ok"] else "FAIL",
                )
            ds, echo, off = costs["duplexserve"], costs[floors.UVICORN], costs["offload path"]
            cpu = "cpu_us_per_frame"
            pw = costs.get(floors.PICOWS, {}).get(cpu, math.nan)
            fast = costs[floors.FAST][cpu]
            ratios = {
                "duplexserve / uvicorn echo": _ratio(ds[cpu], echo[cpu]),
                "duplexserve / picows echo": _ratio(ds[cpu], pw),
                "duplexserve / fast-path echo": _ratio(ds[cpu], fast),
                "fast-path echo / uvicorn echo": _ratio(fast, echo[cpu]),
                "picows echo / uvicorn echo": _ratio(pw, echo[cpu]),
            }
            client = floors.client([r for n in servers for r in runs[n][c]])
            lines.append(
                f"  {c} sessions, server CPU per frame: "
                + ", ".join(f"{name} {value:.2f}x" for name, value in ratios.items())
            )
            line = f"  {c} sessions, {floors.client_line(client)}"
            if floors.client_bound(client):
                line += " (makespans measure the client; CPU per frame is still each server's)"
            lines.append(line)
            checks = (  # (target, measured, met)
                ("server CPU per frame / echo floor's (<= 0.8)", _ratio(ds[cpu], echo[cpu]), 0.8, -1),
                ("offload path CPU per frame / duplexserve's (>= 2)", _ratio(off[cpu], ds[cpu]), 2.0, 1),
                (
                    "offload path makespan / duplexserve's (>= 2)",
                    _ratio(off["makespan_s"], ds["makespan_s"]),
                    2.0,
                    1,
                ),
                ("voluntary context switches per frame (< 0.05)", ds["vcsw_per_frame"], 0.05, -2),
                ("executor submissions per frame (= 0)", ds["exec_per_frame"], 0.0, 0),
            )
            targets = {name: value for name, value, _, _ in checks}
            met = {name: _meets(value, bound, how) for name, value, bound, how in checks}
            summary[str(c)] = {
                "costs": costs, "targets": targets, "met": met, "floor_ratios": ratios, "client": client,
            }
            ok = ok and all(k["guards_ok"] for k in costs.values())
        self.console.print(table)
        for line in lines:
            self.console.print(line)
        self._print_targets(summary)
        img = self.out / "img"
        first = levels[-1]
        plots.bars(
            {n: self._costs(runs[n][first])["cpu_us_per_frame"] for n in servers},
            img / "burst_cpu_per_frame.png",
            "server CPU per frame (us)",
            f"host burst {first} x {self.scale.burst_frames}: server CPU per frame",
        )
        plots.latency_cdf(
            [runs[n][first][0] for n in servers],
            img / "burst_latency_cdf.png",
            f"host burst {first} sessions: frame round trip",
        )
        self._write("burst", {"summary": summary}, [r for n in servers for c in levels for r in runs[n][c]])
        return ok

    def ws(self) -> bool:
        """uvicorn's two WebSocket implementations, by burst CPU per frame."""
        from rich.table import Table

        from duplexserve.bench.servers import Server, running

        self.console.rule("uvicorn WebSocket implementation")
        common = ["--text-every", "0", "--max-sessions", "256"]
        servers = {}
        for impl in ("websockets-sansio", "websockets"):
            servers[f"echo {impl}"] = Server(f"echo {impl}", "echo", ["--ws", impl])
            name = f"duplexserve {impl}"
            servers[name] = Server(name, "duplexserve", [*common, "--ws", impl])
        level = self.scale.burst_levels[:1]
        with running(*servers.values(), pin=self.pin, nice=self.nice):
            self._warm(*servers.values())
            runs = self._interleaved(servers, level, self._burst_spec)
        table = Table(title=f"burst {level[0]} x {self.scale.burst_frames}, median of {self.scale.reps}")
        for col in ("server", "server us/frame", "vcsw/frame", "makespan s", "guards"):
            table.add_column(col, justify="left" if col == "server" else "right")
        costs = {name: self._costs(runs[name][level[0]]) for name in servers}
        for name, k in costs.items():
            table.add_row(
                name,
                f"{k['cpu_us_per_frame']:.1f}",
                f"{k['vcsw_per_frame']:.3f}",
                f"{k['makespan_s']:.2f}",
                "ok" if k["guards_ok"] else "FAIL",
            )
        self.console.print(table)
        sansio = costs["duplexserve websockets-sansio"]["cpu_us_per_frame"]
        legacy = costs["duplexserve websockets"]["cpu_us_per_frame"]
        winner = "websockets-sansio" if sansio <= legacy else "websockets"
        self.console.print(
            f"winner: [bold]{winner}[/] (duplexserve CPU per frame: sansio {sansio:.1f} us, "
            f"websockets {legacy:.1f} us, ratio {_ratio(legacy, sansio):.2f})"
        )
        self._write("ws", {"costs": costs, "winner": winner}, [r for n in servers for r in runs[n][level[0]]])
        return all(k["guards_ok"] for k in costs.values())

    def rtf(self) -> bool:
        """Benchmark 2: paced sessions against an engine that steps like an H200 2B-class model."""
        from rich.table import Table

        from duplexserve.bench.servers import Server, running
        from duplexserve.loadgen import plots

        self.console.rule("RTF run, H200 2B-class step model")
        server = Server(
            "duplexserve",
            "duplexserve",
            [
                "--max-sessions",
                "256",
                "--step-base-ms",
                str(H200_2B_BASE_MS),
                "--step-per-session-ms",
                str(H200_2B_PER_SESSION_MS),
            ],
        )
        results = []
        with running(server, pin=self.pin, nice=self.nice):
            for c in self.scale.rtf_levels:
                r = self._load(
                    server.url,
                    f"rtf c={c}",
                    concurrency=c,
                    sessions=2 * c,
                    warmup=c,
                    frames=self.scale.rtf_frames,
                    message_ms=self.message_ms,
                    paced=True,
                    timeout_s=120.0,
                )
                results.append(r)
                self._say_run(r)
        table = Table(
            title=f"RTF run: {self.scale.rtf_frames * 0.08:.2f} s of audio per session in "
            f"{self.message_ms} ms messages, 2 x c sessions after a warm-up batch"
        )
        for col in (
            "concurrency",
            "wall min/median/max s",
            "RTF min/median/max",
            "rt p50/p99/max ms",
            "underruns",
            "guards",
        ):
            table.add_column(col, justify="right")
        summary = {}
        for c, r in zip(self.scale.rtf_levels, results, strict=True):
            s = r.summary()
            summary[str(c)] = s
            table.add_row(
                str(c),
                f"{s['wall_min_s']:.2f}/{s['wall_median_s']:.2f}/{s['wall_max_s']:.2f}",
                f"{s['rtf_min']:.3f}/{s['rtf_median']:.3f}/{s['rtf_max']:.3f}",
                f"{s['rt_p50_ms']:.1f}/{s['rt_p99_ms']:.1f}/{s['rt_max_ms']:.1f}",
                str(s["underruns"]),
                "ok" if s["guards_ok"] else "FAIL",
            )
        self.console.print(table)
        img = self.out / "img"
        plots.rtf_per_session(results, img / "rtf_per_session.png", "RTF run: RTF per session")
        plots.latency_cdf(results, img / "rtf_latency_cdf.png", "RTF run: frame round trip")
        self._write(
            "rtf",
            {"step_model": {"base_ms": H200_2B_BASE_MS, "per_session_ms": H200_2B_PER_SESSION_MS}},
            results,
        )
        return all(r.guards_ok for r in results)

    def capacity(self) -> bool:
        """Benchmark 3: paced capacity on one server core, judged against the picows echo at each count."""
        from duplexserve.bench.capacity import sweep

        return sweep(self)
