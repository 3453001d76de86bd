"""Host burst, two source trees A and B interleaved in one run: server CPU per frame of each.

Used to price a change on the hot path (docs/benchmarks.md, "Cost of the deadline
metrics"): ``duplexserve bench ab-burst --a /tmp/base --b . --reps 5``. Each tree's
server runs ``python -m duplexserve serve`` from that folder (so that tree's package is
the one imported), pinned to core 0; the load generator (this checkout's) runs the
burst from the other cores. A and B alternate, so both see the same machine minute.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics

from duplexserve.bench.servers import pin_client, serve_tree
from duplexserve.loadgen.runner import LoadSpec, run_load


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--a", required=True, help="source tree A (the baseline)")
    p.add_argument("--b", required=True, help="source tree B (the change)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--frames", type=int, default=512)
    p.add_argument("--b-args", default="", help="extra server flags for B (space separated)")
    p.add_argument("--json", help="write every repetition here")


def run(args: argparse.Namespace) -> int:
    print(pin_client(0))
    rows: dict[str, list[float]] = {"A": [], "B": []}
    for rep in range(args.reps):
        for name, tree in (("A", args.a), ("B", args.b)) if rep % 2 == 0 else (("B", args.b), ("A", args.a)):
            extra = args.b_args.split() if name == "B" else []
            flags = ["--max-sessions", str(max(256, args.concurrency)), *extra]
            proc, port = serve_tree(os.path.abspath(tree), flags, pin=True)
            try:
                spec = LoadSpec(
                    url=f"ws://127.0.0.1:{port}/v1/duplex",
                    concurrency=args.concurrency,
                    sessions=args.concurrency,
                    warmup=args.concurrency,
                    frames=args.frames,
                    message_ms=80,
                    paced=False,
                    timeout_s=60.0,
                )
                result = run_load(spec)
                summary = result.summary()
                assert result.guards_ok, result.failures[:3]
                cpu = summary["server"]["cpu_us_per_frame"]
                rows[name].append(cpu)
                print(
                    f"rep {rep} {name}: {cpu:.2f} us server CPU per frame, "
                    f"makespan {summary['makespan_s']:.2f} s",
                    flush=True,
                )
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
    a, b = statistics.median(rows["A"]), statistics.median(rows["B"])
    pairs = [bb / aa for aa, bb in zip(rows["A"], rows["B"], strict=True)]
    print(
        f"median A {a:.2f} us/frame, B {b:.2f} us/frame, B/A {b / a:.4f}; "
        f"per-rep B/A {', '.join(f'{x:.3f}' for x in pairs)}; "
        f"median of those {statistics.median(pairs):.4f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"A": rows["A"], "B": rows["B"], "median_ratio": b / a, "pair_ratios": pairs}, f)
    return 0
