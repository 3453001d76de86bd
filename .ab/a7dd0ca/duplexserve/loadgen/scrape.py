"""Server cost from two scrapes of ``/metrics``, one before and one after the measured phase.

Both duplexserve and the bare echo server (``loadgen/echo.py``) export the same
counters, read the same way (``getrusage`` of the whole process), so their costs
per frame compare directly.
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from duplexserve.loadgen.metrics import per_frame

CPU = "duplexserve_cpu_seconds_total"
VCSW = "duplexserve_voluntary_context_switches_total"
EXECUTOR = "duplexserve_executor_submissions_total"
FRAMES_OUT = "duplexserve_frames_out_total"
FRAMES_IN = "duplexserve_frames_in_total"
WAKEUPS = "duplexserve_loop_wakeups_total"
STEPS = "duplexserve_engine_steps_total"


def metrics_url(ws_url: str) -> str:
    """``ws://host:port/any`` -> ``http://host:port/metrics``."""
    parts = urlsplit(ws_url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, "/metrics", "", ""))


def parse(text: str) -> dict[str, float]:
    """Prometheus text format; samples with labels are summed under their bare name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        name = name.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def scrape(ws_url: str, timeout: float = 10.0) -> dict[str, float] | None:
    """The server's counters now, or None when it has no /metrics."""
    try:
        with urllib.request.urlopen(metrics_url(ws_url), timeout=timeout) as response:
            return parse(response.read().decode())
    except OSError:
        return None


@dataclass
class ServerCost:
    """Counter increases over the measured phase, per output frame the server sent."""

    frames: float
    cpu_s: float
    voluntary_switches: float
    executor_submissions: float
    loop_wakeups: float
    engine_steps: float

    @property
    def cpu_us_per_frame(self) -> float:
        return 1e6 * per_frame(self.cpu_s, self.frames)

    @property
    def switches_per_frame(self) -> float:
        return per_frame(self.voluntary_switches, self.frames)

    @property
    def executor_per_frame(self) -> float:
        return per_frame(self.executor_submissions, self.frames)

    def as_dict(self) -> dict[str, float]:
        return {
            "frames": self.frames,
            "cpu_s": self.cpu_s,
            "cpu_us_per_frame": self.cpu_us_per_frame,
            "voluntary_switches": self.voluntary_switches,
            "voluntary_switches_per_frame": self.switches_per_frame,
            "executor_submissions": self.executor_submissions,
            "executor_submissions_per_frame": self.executor_per_frame,
            "loop_wakeups": self.loop_wakeups,
            "engine_steps": self.engine_steps,
        }


def cost(before: dict[str, float] | None, after: dict[str, float] | None) -> ServerCost | None:
    if before is None or after is None:
        return None

    def delta(name: str) -> float:
        if name not in after or name not in before:
            return math.nan
        return after[name] - before[name]

    return ServerCost(
        frames=delta(FRAMES_OUT),
        cpu_s=delta(CPU),
        voluntary_switches=delta(VCSW),
        executor_submissions=delta(EXECUTOR),
        loop_wakeups=delta(WAKEUPS),
        engine_steps=delta(STEPS),
    )
