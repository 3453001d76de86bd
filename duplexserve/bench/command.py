"""``duplexserve bench``: every benchmark of docs/benchmarks.md, one subcommand each.

Bare ``duplexserve bench [--short ...]`` runs the suite (burst, ws, rtf, capacity).
Each benchmark's module is imported only when it runs, so a GPU host running the
moshi benchmarks needs none of the others' packages.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass

from duplexserve.subcommands import LazyParser, from_module


@dataclass(frozen=True)
class Benchmark:
    """Where a subcommand lives (a module of duplexserve.bench) and what ``-h`` says of it."""

    module: str
    help: str
    add: str = "add_arguments"  # its options: add(parser)
    run: str = "run"  # run(args) -> exit status (None: 0)


BENCHMARKS = {
    "burst": Benchmark("suite", "host burst: three echo floors, duplexserve, the per-frame offload path"),
    "ws": Benchmark("suite", "uvicorn's two WebSocket implementations, by burst CPU per frame"),
    "rtf": Benchmark("suite", "paced RTF run against an engine stepping like an H200 2B-class model"),
    "capacity": Benchmark("suite", "paced capacity sweep, judged against the picows echo"),
    "all": Benchmark("suite", "burst, ws, rtf and capacity (what bare `duplexserve bench` runs)"),
    "codec-costs": Benchmark("codec_costs", "what each codec path costs per frame, and where it should run"),
    "opus-capacity": Benchmark("opus_capacity", "how many real-time Ogg/Opus sessions a server holds"),
    "opus-cost": Benchmark(
        "opus_cost", "Opus CPU per frame, loop and codec workers apart, per protocol, and PCM"
    ),
    "opus-handoff": Benchmark("opus_handoff", "the loop's hand-off to the codec workers alone, no sockets"),
    "vllm-side-by-side": Benchmark(
        "vllm_side_by_side",
        "vLLM-Omni's own duplex frontend against duplexserve on the same engine",
        run="main",
    ),
    "moshi-steps": Benchmark(
        "moshi",
        "moshi engine: GPU step time against batch size, engine alone",
        add="add_steps_arguments",
        run="cmd_steps",
    ),
    "moshi-rtf": Benchmark(
        "moshi",
        "moshi engine: paced RTF run through the real server",
        add="add_rtf_arguments",
        run="cmd_rtf",
    ),
    "moshi-restart": Benchmark(
        "moshi_restart", "moshi engine: the engine process killed under load, time until sessions run again"
    ),
    "moshi-first-traffic": Benchmark(
        "moshi_first_traffic",
        "moshi engine: a fresh server met by N sessions at once, then a walk through every batch size",
    ),
    "moshi-prompts": Benchmark(
        "moshi_prompt", "moshi engine: a PersonaPlex prompt's prefill against the step", run="main"
    ),
    "moshi-step": Benchmark(
        "moshi_step", "moshi engine: the step broken down, one layer's attention, agreement with batch 1"
    ),
    "ab-burst": Benchmark(
        "ab_burst", "host burst of two source trees, interleaved: server CPU per frame of each"
    ),
    "turnaround-cost": Benchmark(
        "turnaround_cost", "the per-frame CPU of the deadline and replay bookkeeping"
    ),
    "soak": Benchmark("soak", "sessions come and go for a set time; leaks and losses counted"),
    "migrate": Benchmark(
        "migrate", "live migration: calls on a draining replica move to its peer; pause heard, drain to exit"
    ),
    "webrtc-cost": Benchmark(
        "webrtc_cost", "WebRTC calls against the WebSocket Opus path: server CPU a frame, real time held"
    ),
    "bridge-cost": Benchmark("bridge_cost", "the engine thread's own CPU a step and a frame, no sockets"),
    "handoffs": Benchmark(
        "handoffs", "the engine process's step with the event loop idle and saturated: wall time, GIL waits"
    ),
    "http-flood": Benchmark("http_flood", "keep-alive connections pipelining GET /health beside a run"),
    "under-attack": Benchmark(
        "under_attack", "honest sessions' round trip and newcomers under HTTP, parse and slowloris floods"
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from duplexserve.bench import suite

    suite.add_options(p)  # for bare `duplexserve bench`
    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", parser_class=LazyParser)
    for name, bench in BENCHMARKS.items():
        sub.add_parser(
            name,
            help=bench.help,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            define=from_module(f"duplexserve.bench.{bench.module}", bench.add),
        )


def run(args: argparse.Namespace) -> int:
    bench = BENCHMARKS[args.benchmark or "all"]
    module = importlib.import_module(f"duplexserve.bench.{bench.module}")
    return getattr(module, bench.run)(args) or 0
