"""What a person sees: live progress while a run goes, then a summary table and JSON."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table

from duplexserve.loadgen.results import RunResult
from duplexserve.loadgen.summary_columns import COLUMNS, legend


class LiveView:
    """Twice a second: the phase, its elapsed time and ETA, sessions connected and ended, the
    share of the phase's answer frames received (what moves while every session is still
    live), frames per second and the current p99 round trip."""

    def __init__(self, console: Console, enabled: bool = True) -> None:
        self.console = console
        self.enabled = enabled and console.is_terminal
        self._live: Live | None = None
        self._last_frames = 0
        self._last_t = time.monotonic()
        self._phase = ""

    def __enter__(self) -> LiveView:
        if self.enabled:
            self._live = Live(self._render({}), console=self.console, auto_refresh=False, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def update(self, snapshot: dict[str, Any]) -> None:
        if self._live is None:
            return
        self._live.update(self._render(snapshot), refresh=True)

    def _render(self, snap: dict[str, Any]) -> Table:
        now = time.monotonic()
        frames = snap.get("frames", 0)
        if snap.get("phase") != self._phase:
            self._phase, self._last_frames = snap.get("phase", ""), frames
        rate = (frames - self._last_frames) / max(now - self._last_t, 1e-6)
        self._last_frames, self._last_t = frames, now
        recent = snap.get("recent") or []
        p99 = 1e3 * float(np.percentile(recent, 99)) if recent else math.nan
        elapsed = snap.get("elapsed_s", 0.0)
        share = min(1.0, frames / snap["planned"]) if snap.get("planned") else 0.0
        eta = elapsed * (1 - share) / share if share else math.nan
        table = Table(title="duplexserve loadgen", show_header=True)
        for column in ("phase", "elapsed", "ETA", "connected", "ended", "done", "frames/s", "p99 round trip"):
            table.add_column(column, justify="right")
        table.add_row(
            str(snap.get("phase", "starting")),
            _clock(elapsed),
            "-" if math.isnan(eta) else _clock(eta),
            str(snap.get("active", 0)),
            f"{snap.get('done', 0)}/{snap.get('total', 0)}",
            f"{100 * share:.0f}%",
            f"{rate:,.0f}",
            "-" if math.isnan(p99) else f"{p99:.1f} ms",
        )
        return table


def _clock(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour)."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.{digits}f}"
    return str(value)


UNBOUNDED = 1 << 20  # a width no table reaches: its natural width is measured against it


def summary_row(r: RunResult) -> list[str]:
    """One run's values, in the order of :data:`COLUMNS`."""
    s = r.summary()
    server = s.get("server") or {}
    ready = "ready_joining" if r.config.get("arrivals_per_s") else "ready"  # joining: after the ramp
    return [
        r.label,
        "[green]ok[/]" if s["guards_ok"] else f"[red]FAIL {s['failed_sessions']}[/]",
        str(s["sessions"]),
        str(s["frames"]),
        f"{_fmt(s['rtf_min'], 3)}/{_fmt(s['rtf_median'], 3)}/{_fmt(s['rtf_max'], 3)}",
        "/".join(_fmt(s[f"{ready}_{q}_ms"], 1) for q in ("p50", "p99", "max")),
        f"{_fmt(s['rt_p50_ms'], 1)}/{_fmt(s['rt_p99_ms'], 1)}/{_fmt(s['rt_max_ms'], 1)}",
        _fmt(s["lateness_p99_ms"], 1),
        str(s["underruns"]),
        _fmt(server.get("cpu_us_per_frame"), 1),
        _fmt(server.get("voluntary_switches_per_frame"), 3),
        _fmt(server.get("executor_submissions_per_frame"), 3),
        _fmt(s["us_per_frame_wall"], 1),
    ]


def summary_table(results: list[RunResult], width: int) -> Table:
    """One row per run: guards, RTF, round trip, lateness, server and client cost; where that
    is wider than ``width`` (a terminal's), one row per figure and a column per run."""
    rows = [summary_row(r) for r in results]
    table = Table(title="loadgen summary")
    for c in COLUMNS:
        table.add_column(c, justify="left" if c == "run" else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    measure = Console(width=width)
    if Measurement.get(measure, measure.options.update(max_width=UNBOUNDED), table).maximum <= width:
        return table
    table = Table(title="loadgen summary")
    table.add_column("run")
    for row in rows:  # a value folds where even one run is too wide: never cut
        table.add_column(row[0], justify="right", overflow="fold")
    for i, name in enumerate(COLUMNS[1:], 1):
        table.add_row(name, *(row[i] for row in rows))
    return table


def client_line(r: RunResult) -> str:
    """The client's own ceiling, so a reader can see the client was not the bottleneck."""
    c = r.client.as_dict()
    return (
        f"client ({r.label}): {c['processes']} process(es), {_fmt(c['cpu_us_per_frame'], 1)} us CPU per "
        f"frame -> ceiling about {_fmt(c['ceiling_frames_per_s_per_process'], 0)} frames/s per process "
        f"(~{_fmt(c['ceiling_paced_sessions'], 0)} paced sessions); busy {_fmt(100 * c['busy'], 0)}% "
        f"of its time; send lag p99 {_fmt(c['send_lag_p99_ms'], 1)} ms"
    )


def print_report(console: Console, results: list[RunResult]) -> None:
    console.print(summary_table(results, console.width))
    console.print(legend(console.width), style="dim", markup=False, highlight=False, soft_wrap=True)
    for r in results:
        console.print(client_line(r))
        s = r.summary()
        if r.config.get("drop_every"):
            console.print(f"drops ({r.label}): {s['resumes']} connections cut and resumed, "
                          f"{s['frames_replayed']} frames replayed, {s['frames_lost']} lost")
        if r.client.busy > 0.8:
            console.print(f"[yellow]warning: the client was busy {100 * r.client.busy:.0f}% of the time; "
                          "add --processes or cores, the numbers may measure the client[/]")
        for line in r.failures[:10]:
            console.print(f"[red]guard failed[/] {line}")
        if len(r.failures) > 10:
            console.print(f"[red]... and {len(r.failures) - 10} more failed sessions[/]")


def write_json(path: str | Path, results: list[RunResult], extra: dict[str, Any] | None = None) -> None:
    payload = {"runs": [r.as_dict() for r in results], **(extra or {})}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1, default=_jsonable, allow_nan=True) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
