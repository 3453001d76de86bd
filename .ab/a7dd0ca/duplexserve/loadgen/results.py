"""A run's numbers: the sessions' records pooled into the summary the report prints."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplexserve.loadgen import metrics
from duplexserve.loadgen.recorder import SessionResult
from duplexserve.loadgen.scrape import ServerCost


@dataclass
class ClientStats:
    """The load generator's own cost: if it nears its ceiling, the numbers measure it, not the server."""

    processes: int
    cpu_s: float
    wall_s: float
    frames: int
    send_lag: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))

    @property
    def cpu_us_per_frame(self) -> float:
        return 1e6 * metrics.per_frame(self.cpu_s, self.frames)

    @property
    def ceiling_frames_per_s(self) -> float:
        """Frames (one sent, one received) a client process could handle with a whole core."""
        per = metrics.per_frame(self.cpu_s, self.frames)
        return 1.0 / per if per and per > 0 else math.nan

    @property
    def ceiling_paced_sessions(self) -> float:
        return self.processes * self.ceiling_frames_per_s / 12.5

    @property
    def busy(self) -> float:
        """Share of the client processes' time spent on the CPU (1.0: saturated)."""
        return self.cpu_s / (self.wall_s * self.processes) if self.wall_s > 0 else math.nan

    def as_dict(self) -> dict[str, float]:
        return {
            "processes": self.processes,
            "cpu_s": self.cpu_s,
            "wall_s": self.wall_s,
            "frames": self.frames,
            "cpu_us_per_frame": self.cpu_us_per_frame,
            "ceiling_frames_per_s_per_process": self.ceiling_frames_per_s,
            "ceiling_paced_sessions": self.ceiling_paced_sessions,
            "busy": self.busy,
            "send_lag_p99_ms": 1e3 * metrics.percentile(self.send_lag, 99),
            "send_lag_max_ms": 1e3 * float(self.send_lag.max()) if len(self.send_lag) else math.nan,
        }


@dataclass
class RunResult:
    label: str
    config: dict[str, Any]
    sessions: list[SessionResult]
    client: ClientStats
    server: ServerCost | None = None
    warmup_sessions: int = 0

    # ---------------------------------------------------------------- guards
    @property
    def failures(self) -> list[str]:
        """One line per failed session (a run with any has no valid numbers)."""
        out = []
        for s in self.sessions:
            if not s.guards.ok:
                name = f"session {s.index}" + (f" ({s.session_id})" if s.session_id else "")
                out.append(f"{name}: " + "; ".join(s.guards.describe()))
        return out

    @property
    def guards_ok(self) -> bool:
        return bool(self.sessions) and all(s.guards.ok for s in self.sessions)

    # --------------------------------------------------------------- pooled
    @property
    def frames(self) -> int:
        return sum(s.frames_received for s in self.sessions)

    def round_trips(self) -> np.ndarray:
        parts = [s.rt for s in self.sessions if len(s.rt)]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    @property
    def makespan_s(self) -> float:
        """From the first frame sent to the last frame received, over all sessions."""
        firsts = [s.first_sent for s in self.sessions if not math.isnan(s.first_sent)]
        lasts = [s.last_received for s in self.sessions if not math.isnan(s.last_received)]
        return max(lasts) - min(firsts) if firsts and lasts else math.nan

    def steady(self, playback_buffer_frames: int = 1) -> dict[str, Any]:
        """The same metrics over the frames sent while every session of the run was streaming.

        The window opens when the last session sent its first frame and closes when the
        first session sent its last, so the connection ramp and the tail are left out: this
        is what holding N concurrent sessions means.
        """
        live = [s for s in self.sessions if len(s.sent)]
        if not live:
            return {"window_s": 0.0, "frames": 0}
        start = max(float(s.sent[0]) for s in live)
        end = min(float(s.sent[-1]) for s in live)
        rts, lates = [], []
        for s in live:
            n = min(len(s.rt), len(s.sent))
            inside = (s.sent[:n] >= start) & (s.sent[:n] <= end)
            rts.append(s.rt[:n][inside])
            m = min(len(s.late), n)
            lates.append(s.late[:m][inside[:m]])
        rt = np.concatenate(rts) if rts else np.zeros(0, np.float32)
        late = np.concatenate(lates) if lates else np.zeros(0, np.float32)
        return {
            "window_s": max(0.0, end - start),
            "frames": len(rt),
            "rt_p50_ms": 1e3 * metrics.percentile(rt, 50),
            "rt_p99_ms": 1e3 * metrics.percentile(rt, 99),
            "rt_max_ms": 1e3 * float(rt.max()) if len(rt) else math.nan,
            "lateness_p99_ms": 1e3 * metrics.percentile(late, 99),
            "underruns": metrics.underruns(late, playback_buffer_frames),
        }

    def underruns_by_second(self, playback_buffer_frames: int = 1) -> list[int]:
        """Underruns by the second of the run the late frame arrived in (0: the first frame
        sent): a stall shows as a spike across sessions at one moment, a cost paid per
        session (a prompt's prefill as sessions join) as a spread over the run."""
        live = [s for s in self.sessions if len(s.late) and len(s.rt) and len(s.sent)]
        if not live:
            return []
        start = min(float(s.sent[0]) for s in live)
        at = []
        for s in live:
            index = np.flatnonzero(metrics.underrun_mask(s.late, playback_buffer_frames))
            # frame i arrives at the first frame's arrival + i x 80 ms + its lateness
            at.append(float(s.sent[0]) + float(s.rt[0]) + metrics.FRAME_S * index + s.late[index] - start)
        seconds = np.concatenate(at)
        return np.bincount(seconds.astype(np.int64)).tolist() if len(seconds) else []

    def ready(self, joined_only: bool = False) -> dict[str, float]:
        """Time to ready (connect to session.created or the handshake, the prompt run), over
        every session or those that joined in the place of one that ended."""
        ready = np.array([s.ready_s for s in self.sessions if not joined_only or s.joined], np.float64)
        ready = ready[~np.isnan(ready)]
        return {
            "p50_ms": 1e3 * metrics.percentile(ready, 50),
            "p99_ms": 1e3 * metrics.percentile(ready, 99),
            "max_ms": 1e3 * float(ready.max()) if len(ready) else math.nan,
        }

    def summary(self) -> dict[str, Any]:
        rt = self.round_trips()
        rtfs = np.array([s.rtf for s in self.sessions], dtype=np.float64)
        walls = np.array([s.wall_s for s in self.sessions], dtype=np.float64)
        late_parts = [s.late for s in self.sessions if len(s.late)]
        late = np.concatenate(late_parts) if late_parts else np.zeros(0, np.float32)
        makespan = self.makespan_s
        out: dict[str, Any] = {
            "label": self.label,
            "sessions": len(self.sessions),
            "frames": self.frames,
            "guards_ok": self.guards_ok,
            "failed_sessions": sum(1 for s in self.sessions if not s.guards.ok),
            "rtf_min": _nanstat(np.nanmin, rtfs),
            "rtf_median": _nanstat(np.nanmedian, rtfs),
            "rtf_max": _nanstat(np.nanmax, rtfs),
            "wall_min_s": _nanstat(np.nanmin, walls),
            "wall_median_s": _nanstat(np.nanmedian, walls),
            "wall_max_s": _nanstat(np.nanmax, walls),
            "rt_p50_ms": 1e3 * metrics.percentile(rt, 50),
            "rt_p99_ms": 1e3 * metrics.percentile(rt, 99),
            "rt_max_ms": 1e3 * float(rt.max()) if len(rt) else math.nan,
            "lateness_p99_ms": 1e3 * metrics.percentile(late, 99),
            "underruns": sum(s.underruns for s in self.sessions),
            "sessions_with_underruns": sum(1 for s in self.sessions if s.underruns),
            "underruns_by_s": self.underruns_by_second(self.config.get("playback_buffer_frames", 1)),
            "makespan_s": makespan,
            "us_per_frame_wall": 1e6 * makespan / self.frames if self.frames else math.nan,
            "text_events": sum(s.text_events for s in self.sessions),
            "resumes": sum(s.resumes for s in self.sessions),
            "frames_replayed": sum(s.replayed for s in self.sessions),
            "frames_lost": sum(s.frames_lost for s in self.sessions),
        }
        for prefix, joined_only in (("ready", False), ("ready_joining", True)):
            out.update({f"{prefix}_{key}": value for key, value in self.ready(joined_only).items()})
        if self.server is not None:
            out["server"] = self.server.as_dict()
        out["client"] = self.client.as_dict()
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "config": self.config,
            "summary": self.summary(),
            "failures": self.failures,
            "warmup_sessions": self.warmup_sessions,
            "per_session": [
                {
                    "index": s.index, "session_id": s.session_id, "frames_sent": s.frames_sent,
                    "frames_received": s.frames_received, "rtf": s.rtf, "wall_s": s.wall_s,
                    "rt_p50_ms": 1e3 * metrics.percentile(s.rt, 50),
                    "rt_p99_ms": 1e3 * metrics.percentile(s.rt, 99),
                    "lateness_p99_ms": 1e3 * s.lateness_p99, "underruns": s.underruns,
                    "closed_reason": s.closed_reason, "guards": s.guards.describe(),
                    "resumes": s.resumes, "replayed": s.replayed, "frames_lost": s.frames_lost,
                    "ready_ms": 1e3 * s.ready_s, "joined": s.joined,
                }
                for s in self.sessions
            ],
        }


def _nanstat(fn: Any, values: np.ndarray) -> float:
    if not len(values) or np.all(np.isnan(values)):
        return math.nan
    return float(fn(values))
