"""``duplexserve bench capacity``: paced sessions in steps, both floors beside duplexserve at each.

At every count the uvicorn echo, the picows echo and duplexserve take the same paced
load in turn (order alternating), and latency is read over the steady window, while
every session is streaming. docs/benchmarks.md's goal (Definitions): 2000 sessions on one server core,
every frame back in order, p99 round trip at most 2x the picows echo's at the same
count in the same run. A count holds when duplexserve's guards hold and its p99 is
within that bound (within 1.2x of the uvicorn echo's where picows is not installed).
The client's ceiling is printed at every count: above it, the sweep measures the client.
"""

from __future__ import annotations

import math
from typing import Any

from duplexserve.bench import floors

GOAL_SESSIONS = 2000
PICOWS_BOUND = 2.0  # docs/benchmarks.md, Definitions: p99 at most 2x the picows echo's
UVICORN_BOUND = 1.2  # the earlier target, used only without picows


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def _p(steady: dict[str, Any], key: str) -> float:
    return float(steady.get(key, math.nan))


def _server_cpu(run: Any) -> float:
    return (run.summary().get("server") or {}).get("cpu_us_per_frame", math.nan)


def _pair(steady: dict[str, Any] | None) -> str:
    if not steady or not steady.get("frames"):
        return "-"  # no steady window: the run never had every session streaming at once
    return f"{_p(steady, 'rt_p50_ms'):.1f}/{_p(steady, 'rt_p99_ms'):.1f}"


def sweep(bench: Any) -> bool:
    """Run the sweep on ``bench`` (a :class:`duplexserve.bench.suite.Bench`); prints, plots, writes JSON."""
    from duplexserve.bench.servers import Server, running
    from duplexserve.loadgen import plots
    from duplexserve.loadgen.runner import LoadSpec

    console, scale = bench.console, bench.scale
    console.rule("paced capacity sweep")
    levels = scale.capacity_levels
    servers, note = floors.servers()
    if note:
        console.print(f"[yellow]{note}[/]")
    servers["duplexserve"] = Server("duplexserve", "duplexserve", ["--max-sessions", str(max(levels) + 16)])
    judge, bound = floors.PICOWS, PICOWS_BOUND
    if judge not in servers:
        judge, bound = floors.UVICORN, UVICORN_BOUND
    runs: dict[str, dict[int, Any]] = {n: {} for n in servers}
    steady_s = scale.capacity_steady_s
    with running(*servers.values(), pin=bench.pin, nice=bench.nice):
        bench._warm(*servers.values())
        for i, c in enumerate(levels):
            ramp = LoadSpec(url="", concurrency=c).ramp()
            frames = math.ceil((ramp + steady_s + 0.5) / 0.08)
            order = list(servers) if i % 2 == 0 else list(reversed(servers))
            for name in order:
                r = bench._load(
                    servers[name].url, f"{name} {c} paced", concurrency=c, sessions=c, frames=frames,
                    message_ms=bench.message_ms, paced=True, timeout_s=120.0,
                )  # fmt: skip
                runs[name][c] = r
                bench._say_run(r)
                st, lag = r.steady(), r.client.as_dict()["send_lag_p99_ms"]
                console.print(
                    f"    steady {st['window_s']:.1f} s: rt p50/p99 {_pair(st)} ms, underruns "
                    f"{st.get('underruns', 0)}, client send lag p99 {lag:.1f} ms"
                )
    rows, held = _judge(runs, levels, judge, bound)
    _print(bench, rows, steady_s)
    console.print(
        f"largest count held: [bold]{held}[/] (guards, p99 <= {bound:g}x the {judge}'s at the same count)"
    )
    goal = _goal(rows, judge, bound)
    if goal:
        console.print(goal)
    series = {
        name: [(c, r.summary()["rtf_median"], _p(r.steady(), "rt_p99_ms")) for c, r in runs[name].items()]
        for name in servers
    }
    plots.sweep(series, bench.out / "img" / "capacity_sweep.png", "paced capacity: RTF and steady p99")
    bench._write(
        "capacity",
        {"held": held, "judged_against": judge, "bound": bound, "levels": rows},
        [r for n in servers for r in runs[n].values()],
    )
    return True


def _judge(
    runs: dict[str, dict[int, Any]], levels: tuple[int, ...], judge: str, bound: float
) -> tuple[dict[str, Any], int]:
    """Per count: each server's steady numbers, the ratios, the client's ceiling, and whether it held."""
    rows: dict[str, Any] = {}
    held = 0
    for c in levels:
        ds = runs["duplexserve"][c]
        steady = {name: runs[name][c].steady() for name in runs}
        d99 = _p(steady["duplexserve"], "rt_p99_ms")
        ratios = {name: _ratio(d99, _p(steady[name], "rt_p99_ms")) for name in runs if name != "duplexserve"}
        floors_ok = all(runs[name][c].guards_ok for name in runs)
        ok = ds.guards_ok and runs[judge][c].guards_ok and ratios[judge] <= bound
        held = max(held, c) if ok else held
        client = floors.client([runs[name][c] for name in runs])
        rows[str(c)] = {
            "echo": steady[floors.UVICORN],
            "fast_echo": steady[floors.FAST],
            "picows_echo": steady.get(floors.PICOWS),
            "duplexserve": steady["duplexserve"],
            "p99_ratio": ratios[floors.UVICORN],
            "p99_ratio_picows": ratios.get(floors.PICOWS, math.nan),
            "held": ok,
            "guards_ok": ds.guards_ok,
            "floors_guards_ok": floors_ok,
            "server_us_per_frame": {
                "echo": _server_cpu(runs[floors.UVICORN][c]),
                "fast_echo": _server_cpu(runs[floors.FAST][c]),
                "picows_echo": _server_cpu(runs[floors.PICOWS][c]) if floors.PICOWS in runs else math.nan,
                "duplexserve": _server_cpu(ds),
            },
            "client_send_lag_p99_ms": client["send_lag_p99_ms_max"],
            "client": client,
            "client_bound": floors.client_bound(client, c),
        }
    return rows, held


def _print(bench: Any, rows: dict[str, Any], steady_s: float) -> None:
    from rich.table import Table

    latency = Table(
        title=f"paced capacity: {bench.message_ms} ms messages; latency over the steady window "
        f"(~{steady_s:.0f} s with every session streaming)"
    )
    for col in ("sessions", "uvicorn echo p50/p99 ms", "fast-path echo p50/p99 ms", "picows echo p50/p99 ms",
                "duplexserve p50/p99 ms", "p99 / uvicorn", "p99 / picows", "underruns u/f/p/ds",
                "held"):  # fmt: skip
        latency.add_column(col, justify="right")
    cost = Table(title="paced capacity: server CPU per frame and the client's ceiling")
    for col in ("sessions", "server us/frame u/f/p/ds", "client us/frame", "client ceiling sessions",
                "client lag p99 ms", "client-bound"):  # fmt: skip
        cost.add_column(col, justify="right")
    for c, row in rows.items():
        e, f, p, d = row["echo"], row["fast_echo"], row["picows_echo"], row["duplexserve"]
        under = "/".join(str(s["underruns"]) if s and s.get("frames") else "-" for s in (e, f, p, d))
        latency.add_row(
            c, _pair(e), _pair(f), _pair(p), _pair(d), f"{row['p99_ratio']:.2f}",
            f"{row['p99_ratio_picows']:.2f}", under, "yes" if row["held"] else "no",
        )  # fmt: skip
        us = row["server_us_per_frame"]
        client = row["client"]
        cost.add_row(
            c, "/".join(f"{us[k]:.1f}" for k in ("echo", "fast_echo", "picows_echo", "duplexserve")),
            f"{client['cpu_us_per_frame']:.1f}", f"{client['ceiling_paced_sessions']:,.0f}",
            f"{row['client_send_lag_p99_ms']:.1f}", "[red]yes[/]" if row["client_bound"] else "no",
        )  # fmt: skip
    bench.console.print(latency)
    bench.console.print(cost)


def _goal(rows: dict[str, Any], judge: str, bound: float) -> str:
    """docs/benchmarks.md's paced goal, judged at 2000 when the sweep reached it."""
    row = rows.get(str(GOAL_SESSIONS))
    if row is None:
        return f"goal ({GOAL_SESSIONS} sessions) not judged: the sweep did not run {GOAL_SESSIONS}"
    ratio = row["p99_ratio_picows"] if judge == floors.PICOWS else row["p99_ratio"]
    mark = "[green]met[/]" if row["held"] else "[red]missed[/]"
    if math.isnan(ratio):
        mark += " (no steady window: duplexserve or the floor never had every session streaming)"
    bound_note = " [red](client-bound: see the client ceiling)[/]" if row["client_bound"] else ""
    return (
        f"goal: {GOAL_SESSIONS} sessions, guards, p99 <= {bound:g}x the {judge}'s in the same run: "
        f"{ratio:.2f}x {mark}{bound_note}"
    )
