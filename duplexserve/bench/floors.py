"""The floors duplexserve is measured against, and the client's own ceiling.

The uvicorn echo (:mod:`duplexserve.loadgen.echo`) is the floor of duplexserve's own
stack: what ASGI under uvicorn costs with nothing behind it. The same echo on
duplexserve's fast path (``--ws fast``) is the floor of that path's framing and
transport: what duplexserve costs beyond it is its sessions and engine hand-off. The picows echo
(:mod:`duplexserve.loadgen.echo_picows`) is the floor of Python WebSocket code, the one
docs/benchmarks.md's paced goal is judged against. All run beside duplexserve in one run,
since timings are only comparable within the same minute.

A floor is only a floor if the client can outrun it: the load generator's own CPU per
frame says how many frames per second one client core can drive, printed beside
every result so a client-bound run can be told from a server-bound one.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
from typing import Any

from duplexserve.bench.servers import Server

UVICORN = "echo floor"  # the name the JSON has always used for the uvicorn echo
FAST = "fast-path echo floor"
PICOWS = "picows floor"
FRAME_S = 0.08
#: Above this share of one client core (or of a paced count's demand on it) the client, not
#: the server, may be what a run measures.
CLIENT_BOUND_SHARE = 0.9


def have_picows() -> bool:
    return importlib.util.find_spec("picows") is not None


def servers() -> tuple[dict[str, Server], str]:
    """The floors to start, and a note to print when picows is missing (its floor is then left out)."""
    out = {UVICORN: Server(UVICORN, "echo", []), FAST: Server(FAST, "echo", ["--ws", "fast"])}
    if not have_picows():
        return out, "picows is not installed (pip install '.[bench]'): the picows floor is left out"
    out[PICOWS] = Server(PICOWS, "picows-echo", [])
    return out, ""


def _median(values: list[float]) -> float:
    clean = [v for v in values if not math.isnan(v)]
    return statistics.median(clean) if clean else math.nan


def client(runs: list[Any]) -> dict[str, float]:
    """The load generator's cost over ``runs`` (any servers, one level): medians, and the busiest run.

    ``ceiling_frames_per_s`` is per client process: the frames (one sent, one received)
    it could handle with a whole core; ``ceiling_paced_sessions`` is what that feeds at
    one frame per 80 ms per session, over all client processes.
    """
    stats = [r.client.as_dict() for r in runs]
    per_frame = _median([s["cpu_us_per_frame"] for s in stats])
    processes = max((s["processes"] for s in stats), default=1)
    fps = 1e6 / per_frame if per_frame > 0 else math.nan
    return {
        "cpu_us_per_frame": per_frame,
        "ceiling_frames_per_s": fps,
        "ceiling_paced_sessions": processes * fps * FRAME_S,
        "busy_max": max((s["busy"] for s in stats), default=math.nan),
        "send_lag_p99_ms_max": max((s["send_lag_p99_ms"] for s in stats), default=math.nan),
    }


def client_bound(ceiling: dict[str, float], sessions: int | None = None) -> bool:
    """The client near its core: busy most of a run, or a paced count near what it can feed."""
    if ceiling["busy_max"] >= CLIENT_BOUND_SHARE:
        return True
    return sessions is not None and sessions >= CLIENT_BOUND_SHARE * ceiling["ceiling_paced_sessions"]


def client_line(ceiling: dict[str, float], sessions: int | None = None) -> str:
    """One line for a reader: the client's cost per frame and the most it can drive."""
    paced = f", {ceiling['ceiling_paced_sessions']:.0f} paced sessions" if sessions is not None else ""
    bound = "[red]client-bound[/]" if client_bound(ceiling, sessions) else "not client-bound"
    return (
        f"client ceiling: {ceiling['cpu_us_per_frame']:.1f} us of client CPU per frame, so one client core "
        f"drives at most {ceiling['ceiling_frames_per_s']:,.0f} frames/s{paced}; busiest run "
        f"{100 * ceiling['busy_max']:.0f}% of a core: {bound}"
    )
