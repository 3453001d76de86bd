"""The guards of a run: every output frame back, in order, with the right content and format.

A run whose guard fails has no valid numbers. :class:`FrameChecker` follows one
session online: it is told each expected output frame as soon as the input that causes
it has been sent, and each received frame as it arrives, and it keeps only the frames
still unanswered, so a long run never stores the audio it received. When a frame does
not match, it looks ahead and behind to say what happened: a frame that never came is
*dropped*, a frame that came after a later one is *reordered*, a frame whose bytes match
no frame sent is *altered*.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

MAX_DETAILS = 8  # per session: the first few failures are enough to find the bug


@dataclass
class GuardReport:
    """What went wrong in one session; empty when its guards held."""

    dropped: list[int] = field(default_factory=list)
    reordered: list[int] = field(default_factory=list)
    altered: list[int] = field(default_factory=list)
    wrong_format: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    missing: int = 0  # frames expected and never received, at the end
    extra: int = 0  # frames received beyond all expected

    @property
    def ok(self) -> bool:
        return not (
            self.dropped or self.reordered or self.altered or self.wrong_format or self.errors
            or self.missing or self.extra
        )

    def describe(self) -> list[str]:
        """One line per kind of failure, naming the frames."""
        out = []
        for kind, frames in (("dropped", self.dropped), ("reordered", self.reordered),
                             ("altered", self.altered)):
            if frames:
                shown = ", ".join(str(i) for i in frames[:MAX_DETAILS])
                more = f" (+{len(frames) - MAX_DETAILS} more)" if len(frames) > MAX_DETAILS else ""
                out.append(f"frame{'s' if len(frames) > 1 else ''} {shown}{more} {kind}")
        if self.missing:
            out.append(f"{self.missing} frame{'s' if self.missing > 1 else ''} never came back")
        if self.extra:
            out.append(f"{self.extra} frame{'s' if self.extra > 1 else ''} more than were sent")
        out.extend(f"wrong format: {w}" for w in self.wrong_format[:MAX_DETAILS])
        out.extend(f"error: {e}" for e in self.errors[:MAX_DETAILS])
        return out


class FrameChecker:
    """Online order and content check of one session's output frames.

    ``check_content=False`` only counts (for engines whose output cannot be predicted);
    order is then unverifiable and only missing and extra frames are reported.
    """

    def __init__(self, check_content: bool = True) -> None:
        self.check_content = check_content
        self.report = GuardReport()
        self.expected_count = 0
        self.received = 0
        self._pending: collections.deque[tuple[int, bytes]] = collections.deque()
        self._skipped: dict[int, bytes] = {}  # passed over by a later frame, not yet seen

    def expect(self, frame: bytes) -> None:
        """The output frame that the next input frame must produce."""
        if self.check_content:
            self._pending.append((self.expected_count, frame))
        self.expected_count += 1

    def receive(self, data: bytes) -> None:
        position = self.received
        self.received += 1
        if not self.check_content:
            return
        pending = self._pending
        if pending and pending[0][1] == data:  # the common case: one compare
            pending.popleft()
            return
        self._mismatch(position, data)

    def _mismatch(self, position: int, data: bytes) -> None:
        pending, report = self._pending, self.report
        for ahead, (_index, frame) in enumerate(pending):
            if frame == data:
                for _ in range(ahead):  # passed over: dropped unless they turn up later
                    skipped_index, skipped_frame = pending.popleft()
                    self._skipped[skipped_index] = skipped_frame
                pending.popleft()
                return
        for index, frame in self._skipped.items():
            if frame == data:
                del self._skipped[index]
                report.reordered.append(index)
                return
        if pending:
            index, _ = pending.popleft()
            report.altered.append(index)
        else:
            report.extra += 1

    def finish(self) -> GuardReport:
        """Close the books: what was passed over and never came is dropped."""
        report = self.report
        report.dropped = sorted(self._skipped)
        self._skipped.clear()
        if self.check_content:
            report.missing = len(self._pending)
            self._pending.clear()
        else:
            report.missing = max(0, self.expected_count - self.received)
            report.extra = max(0, self.received - self.expected_count)
        return report
