"""``duplexserve bench moshi-first-traffic``: a fresh server's first traffic, at its defaults.

A replica the autoscaler adds, or a restarted one, meets full traffic at once and is never
idle after: whatever its start left for later (a bucket's CUDA graphs, capture_plan.py)
must not cost a live frame. This starts the server as ``moshi-rtf`` does (its defaults
unless told), then, with no warm-up batch:

- **burst**: ``--sessions`` N sessions open at once; after ``--burst-s`` they leave one
  every ``--step-s``, so the batch walks down through every bucket size;
- **walk**: as the last of them leaves, N - 2 new sessions join one every ``--step-s`` and
  then leave one every ``--step-s`` (the last to join first): the batch walks up through
  every bucket size and down again, never empty, so the server is never idle.

It reports late frames (one frame of playback buffer, as ``moshi-rtf``) by phase, the
sessions hit, the frame round trip, the steps over 80/100/200 ms (the server's histogram)
and the seconds from the server's start to ``/ready``. A JSON line goes to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np

from duplexserve.bench.moshi import (
    FRAME,
    FRAME_S,
    _over,
    add_rtf_arguments,
    one_session,
    pct,
    scrape,
    started_server,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_rtf_arguments(p)
    p.add_argument("--burst-s", type=float, default=10.0, help="seconds the N sessions stream together")
    p.add_argument("--step-s", type=float, default=0.05, help="seconds between two joins or two leaves")


def schedule(n: int, burst_s: float, step_s: float, min_s: float = 1.0) -> list[tuple[str, float, float]]:
    """(phase, start, seconds) of every session, on the run's clock: at most ``n`` live at any
    time (the server's slots), never none from the first start to the last end."""
    burst = [("burst", 0.0, burst_s + j * step_s) for j in range(n)]
    walk_at = burst_s + (n - 1.5) * step_s  # one burst session left: it ends half a step later
    m = max(1, n - 2)
    walk = [("walk", walk_at + i * step_s, (2 * m - 1 - 2 * i) * step_s + min_s) for i in range(m)]
    return burst + walk


async def _sessions(url: str, plan: list[tuple[str, float, float]], message_ms: int) -> list[dict]:
    longest = max(seconds for _, _, seconds in plan)
    audio = (np.random.default_rng(1).standard_normal(int(longest / FRAME_S) * FRAME) * 0.05).astype(
        np.float32
    )
    t0 = asyncio.get_running_loop().time() + 0.5
    results: list[dict] = [{"phase": phase} for phase, _, _ in plan]
    tasks = [
        one_session(url, audio[: int(seconds / FRAME_S) * FRAME], t0 + start, message_ms // 80, r)
        for (_, start, seconds), r in zip(plan, results, strict=True)
    ]
    done = await asyncio.gather(*tasks, return_exceptions=True)
    for r, d in zip(results, done, strict=True):
        if isinstance(d, BaseException):
            r.setdefault("error", repr(d))
    return results


def summarize(results: list[dict], delta, startup_s: float) -> dict:  # type: ignore[no-untyped-def]
    """Late frames and round trips by phase, the steps that ran long, start to ready."""
    ok = [r for r in results if "rtt" in r]
    out: dict = {
        "startup_s": startup_s,
        "sessions": len(results),
        "errors": sum("error" in r for r in results),
    }
    for phase in ("burst", "walk"):
        mine = [r for r in ok if r["phase"] == phase]
        out[f"{phase}_late_frames"] = int(sum((r["lateness"] > 0).sum() for r in mine))
        out[f"{phase}_sessions_with_late_frames"] = sum(1 for r in mine if (r["lateness"] > 0).any())
    out["late_frames"] = out["burst_late_frames"] + out["walk_late_frames"]
    rtt = np.concatenate([r["rtt"] for r in ok]) if ok else np.zeros(1)
    out.update(
        complete_sessions=sum(1 for r in ok if r["frames_out"] == r["frames_in"] and "error" not in r),
        rtt_ms_p50=1000 * pct(rtt, 50), rtt_ms_p99=1000 * pct(rtt, 99), rtt_ms_max=1000 * float(rtt.max()),
        steps=delta("duplexserve_engine_step_seconds_count"),
        steps_over_ms=_over(delta, "duplexserve_engine_step_seconds", (80, 100, 200)),
    )  # fmt: skip
    steps = out["steps"]
    out["step_ms_mean"] = 1000 * delta("duplexserve_engine_step_seconds_sum") / steps if steps else None
    return out


def run(args: argparse.Namespace) -> None:
    plan = schedule(max(args.sessions), args.burst_s, args.step_s)
    with started_server(args) as (_, startup, serve_command):
        before = scrape(args.port)
        results = asyncio.run(_sessions(f"ws://127.0.0.1:{args.port}/v1/duplex", plan, args.message_ms))
        after = scrape(args.port)
    summary = summarize(results, lambda name: after.get(name, 0.0) - before.get(name, 0.0), startup)
    summary.update(preset=args.preset, kv_dtype=args.kv_dtype, serve=serve_command)
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "a") as out:
            out.write(json.dumps(summary) + "\n")
