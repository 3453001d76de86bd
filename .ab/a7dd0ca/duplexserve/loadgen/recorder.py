"""One session's record: when each frame went out and came back, and its guards.

The recorder is the driver's :class:`~duplexserve.loadgen.drivers.base.Sink`. Per
output frame it appends one timestamp and does one bytes compare; everything else is
computed once at the end, in :meth:`SessionRecorder.result`.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplexserve.codecs.formats import SAMPLE_BYTES, AudioFormat
from duplexserve.loadgen import metrics
from duplexserve.loadgen.guards import FrameChecker, GuardReport


@dataclass
class SessionResult:
    """What a session measured; ``rt`` holds its frame round trips in seconds."""

    index: int
    session_id: str
    frames_sent: int
    frames_expected: int
    frames_received: int
    first_sent: float
    last_received: float
    rtf: float
    rt: np.ndarray
    late: np.ndarray
    sent: np.ndarray  # when each input frame left, for windows over the run
    lateness_p99: float
    lateness_max: float
    underruns: int
    text_events: int
    closed_reason: str
    guards: GuardReport = field(default_factory=GuardReport)
    resumes: int = 0  # --drop-every: connections cut and resumed
    ready_s: float = math.nan  # connect to the protocol's go-ahead (session.created, handshake)
    joined: bool = False  # took the place of a session that ended (not the first of its slot)
    replayed: int = 0  # output frames the server sent again after a resume
    frames_lost: int = 0  # output frames no longer kept at a resume (a guard failure)

    @property
    def wall_s(self) -> float:
        return self.last_received - self.first_sent if self.frames_received else math.nan


class SessionRecorder:
    def __init__(self, index: int, output: AudioFormat, check_content: bool, recent: list[float]) -> None:
        self.index = index
        self.output = output
        self.session_id = ""
        self.sent = array("d")
        self.received = array("d")
        self.checker = FrameChecker(check_content)
        self.text_events = 0
        self.closed_reason = ""
        self.disconnected = False
        self.close_code: int | None = None
        self.done_callback: Any = None
        self.resumes = self.replayed = self.frames_lost = 0
        self.ready_s = math.nan
        self.joined = False
        width = SAMPLE_BYTES.get(output.format)
        self._frame_bytes = width * output.frame_samples if width else 0
        self._recent = recent  # shared by a worker: round trips for the live p99

    # ------------------------------------------------------------------ sending
    def sent_frames(self, frames: list[bytes], count: int, now: float) -> None:
        """A message went out that completes ``count`` input frames, answered by ``frames``
        (none when the answers cannot be predicted: then only their count is checked)."""
        checker = self.checker
        if checker.check_content:
            for frame in frames:
                checker.expect(frame)
        else:
            checker.expected_count += count
        sent = self.sent
        for _ in range(count):
            sent.append(now)

    # -------------------------------------------------------------------- Sink
    def on_ready(self, info: dict[str, Any]) -> None:
        self.session_id = str(info.get("session_id", ""))
        out = info.get("output")
        if isinstance(out, dict):
            want = (self.output.format, self.output.sample_rate)
            got = (out.get("format"), out.get("sample_rate"))
            if got != want:
                self.checker.report.wrong_format.append(f"server announced output {got}, asked for {want}")

    def on_audio(self, data: bytes, now: float) -> None:
        received = self.received
        i = len(received)
        if i >= len(self.sent):  # input.end's tail: the model finishing on silence answers no
            return  # frame of ours, so there is nothing to time or check
        received.append(now)
        self._recent.append(now - self.sent[i])
        if self._frame_bytes and len(data) != self._frame_bytes:
            report = self.checker.report
            if len(report.wrong_format) < 8:
                report.wrong_format.append(f"frame {i} has {len(data)} bytes, not {self._frame_bytes}")
        self.checker.receive(data)

    def on_text(self, now: float) -> None:
        self.text_events += 1

    def on_error(self, code: str, message: str, fatal: bool) -> None:
        self.checker.report.errors.append(f"{code}: {message}")

    def on_closed(self, reason: str, info: dict[str, Any]) -> None:
        self.closed_reason = reason
        if reason != "completed":
            self.checker.report.errors.append(f"session closed: {reason}")
        dropped = info.get("frames_dropped")
        if dropped:
            self.checker.report.errors.append(f"server dropped {dropped} frames")

    def on_disconnect(self, code: int | None, reason: str) -> None:
        self.disconnected = True
        self.close_code = code
        if code not in (1000, None) or (code is None and self.closed_reason != "completed"):
            self.checker.report.errors.append(f"connection closed with {code} {reason}".rstrip())
        if self.done_callback is not None:
            self.done_callback()

    def on_resumed(self, info: dict[str, Any]) -> None:
        self.resumes += 1
        self.replayed += int(info.get("replayed", 0))
        lost = int(info.get("frames_lost", 0))
        self.frames_lost += lost
        if lost:
            self.checker.report.errors.append(f"resume {self.resumes}: the server lost {lost} frames")

    # ------------------------------------------------------------------ results
    def fail(self, why: str) -> None:
        self.checker.report.errors.append(why)

    def result(self, playback_buffer_frames: int = 1) -> SessionResult:
        guards = self.checker.finish()
        if not self.closed_reason and not guards.errors:
            guards.errors.append("the session never completed")
        sent = np.frombuffer(self.sent, dtype=np.float64) if len(self.sent) else np.zeros(0)
        received = np.frombuffer(self.received, dtype=np.float64) if len(self.received) else np.zeros(0)
        late = metrics.lateness(received)
        return SessionResult(
            index=self.index,
            session_id=self.session_id,
            frames_sent=len(sent),
            frames_expected=self.checker.expected_count,
            frames_received=len(received),
            first_sent=float(sent[0]) if len(sent) else math.nan,
            last_received=float(received[-1]) if len(received) else math.nan,
            rtf=metrics.rtf(float(sent[0]), float(received[-1]), len(received))
            if len(sent) and len(received) else math.nan,
            rt=metrics.round_trips(sent, received).astype(np.float32),
            late=late.astype(np.float32),
            sent=sent.copy(),
            lateness_p99=metrics.percentile(late, 99),
            lateness_max=float(late.max()) if len(late) else math.nan,
            underruns=metrics.underruns(late, playback_buffer_frames),
            text_events=self.text_events,
            closed_reason=self.closed_reason,
            guards=guards,
            resumes=self.resumes,
            replayed=self.replayed,
            frames_lost=self.frames_lost,
            ready_s=self.ready_s,
            joined=self.joined,
        )
