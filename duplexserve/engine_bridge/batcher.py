"""Per-slot FIFOs of pending frames, gathered into one batch a step.

Stepping at once (the default), :class:`FifoBatcher` keeps them in a deque a slot. On a
step clock, :class:`SlotBatcher` keeps them with each frame's due time, as references to
the views the loop handed over (no copy), in a (slots x window) object ring. A step
takes the oldest frame of every slot that has one: the indices, the generations and the
frames come out of fancy indexing. Either way the one copy is ``np.concatenate``
building the contiguous batch the model eats (a third of ``np.stack``'s cost: no view
and shape check per frame).

On the clock each frame also gets the time it is due on its
session's own schedule: frame k of a slot is due at ``ref + k x frame`` where ``ref`` is
the earliest phase the sender has shown lately (``arrival - k x frame`` of the first frame
of each message; frames put in one loop iteration share their arrival): the smallest so
far, moved ``CREEP_S`` later a message to follow a sender whose clock runs slow. So a frame
that comes a little late keeps its place in the schedule, the second frame of a 160 ms
message is due 80 ms after the first, and a burst sender's frames fall due one a frame.
A message a whole frame behind the schedule (a sender that paused) starts a new one.

Gathering (:class:`Gather`) steps at once but, under load, lets a step wait for the frames
due within its own duration: the same schedules say which sessions are about to send.
"""

from __future__ import annotations

import collections
import math

import numpy as np

#: How long before a tick a frame must be due to be stepped at that tick: a frame up to
#: this late against its schedule still makes its tick.
SLACK_S = 0.010
#: How far a session's schedule moves later a message (its clock may run slow), unless a
#: message shows an earlier phase.
CREEP_S = 0.00005


def _batch(frames: list[np.ndarray], out: np.ndarray | None) -> np.ndarray:
    """The step's frames as one (rows x samples) batch: the first rows of ``out`` when the
    engine offers its input buffer, else a new array. The one copy of each frame.

    Copied as bytes through a memoryview, which keeps the GIL: numpy lets the GIL go for
    any copy of over 500 items, so ``np.concatenate`` let it go once a frame, and each time
    the engine thread waited for the event loop to hand it back. Gathering 256 frames took
    5.4 ms so with the loop busy, against 0.2 alone (docs/moshi-engine.md)."""
    first = frames[0]
    batch = np.empty((len(frames), first.size), first.dtype) if out is None else out[: len(frames)]
    dtype = batch.dtype
    target = memoryview(batch.reshape(-1)).cast("B")
    width = first.nbytes
    at = 0
    for frame in frames:
        if frame.dtype != dtype:  # bytes are copied, not values: every frame's format must agree
            raise TypeError(f"frames of {frame.dtype} for a batch of {dtype}")
        target[at : at + width] = memoryview(frame).cast("B")
        at += width
    return batch


class SlotBatcher:
    def __init__(self, num_slots: int, window: int, frame_s: float) -> None:
        self.window = window
        self.frame_s = frame_s  # the clock's period: frames fall due one such apart
        self._ring = np.empty((num_slots, window), dtype=object)
        self._head = np.zeros(num_slots, dtype=np.int64)
        self._count = np.zeros(num_slots, dtype=np.int64)
        self._generation = np.full(num_slots, -1, dtype=np.int64)
        self._due = np.zeros((num_slots, window), dtype=np.float64)
        self._arrived = np.zeros((num_slots, window), dtype=np.float64)
        #: Of the frames the last clock gather took, the latest arrival past its due time.
        self.arrived_past_due = 0.0
        self._ref = [math.inf] * num_slots  # the schedule's phase (see above)
        self._pushed = [0] * num_slots  # frames pushed since the slot opened
        self._received = [math.nan] * num_slots  # when its last frame came
        self.pending = 0  # frames held over all slots

    def open(self, slot: int, generation: int) -> None:
        self.close(slot)
        self._generation[slot] = generation

    def close(self, slot: int) -> None:
        self.pending -= int(self._count[slot])
        self._ring[slot] = None
        self._head[slot] = 0
        self._count[slot] = 0
        self._generation[slot] = -1
        self._ref[slot] = math.inf
        self._pushed[slot] = 0
        self._received[slot] = math.nan

    def held(self, slot: int) -> int:
        """Frames of ``slot`` waiting for a step."""
        return int(self._count[slot])

    def push(self, slot: int, generation: int, frame: np.ndarray, now: float = 0.0) -> bool:
        """Queue a frame received at ``now``; False when the slot's window is full.

        A frame of a slot not open under that generation (a session already closed)
        is dropped and counts as taken: there is nothing to answer.
        """
        if self._generation[slot] != generation:
            return True
        count = self._count[slot]
        if count >= self.window:
            return False
        index = (self._head[slot] + count) % self.window
        self._ring[slot, index] = frame
        k = self._pushed[slot]
        self._pushed[slot] = k + 1
        ref = self._ref[slot]
        if now != self._received[slot]:  # the first frame of a message: a phase seen
            self._received[slot] = now
            phase = now - k * self.frame_s
            # a sender a frame behind its schedule paused: a new schedule from here
            ref = phase if phase > ref + self.frame_s else min(ref + CREEP_S, phase)
            self._ref[slot] = ref
        self._due[slot, index] = ref + k * self.frame_s
        self._arrived[slot, index] = now
        self._count[slot] = count + 1
        self.pending += 1
        return True

    def oldest_due(self) -> float:
        """When the most overdue frame waiting at the head of its slot was due."""
        slots = np.flatnonzero(self._count)
        return float(self._due[slots, self._head[slots]].min()) if len(slots) else math.inf

    def gather(
        self, cutoff: float = math.inf, out: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pop one frame from every slot whose next frame is due by ``cutoff``:
        (slots, generations, batch). With ``out`` (rows x frame samples, rows at least the
        slots) the batch is its first rows: written where the engine reads it, instead of
        into a new array that the engine then copies."""
        slots = np.flatnonzero(self._count)
        heads = self._head[slots]
        if cutoff != math.inf:
            due = self._due[slots, heads]
            taken = due <= cutoff
            slots, heads = slots[taken], heads[taken]
            if not len(slots):
                return slots, slots, np.empty((0, 0), np.float32)
            self.arrived_past_due = float((self._arrived[slots, heads] - due[taken]).max())
        frames = _batch(self._ring[slots, heads].tolist(), out)
        self._ring[slots, heads] = None
        self._head[slots] = (heads + 1) % self.window
        self._count[slots] -= 1
        self.pending -= len(slots)
        return slots, self._generation[slots], frames


    def expected_by(self, deadline: float, now: float) -> bool:
        """Whether an open slot holding no frame has its next frame due by ``deadline`` (and
        not long overdue: a sender more than half a frame behind has paused, or ended)."""
        missing = (self._count == 0) & (self._generation >= 0)
        if not missing.any():
            return False
        due = np.asarray(self._ref)[missing] + np.asarray(self._pushed)[missing] * self.frame_s
        return bool(((due <= deadline) & (due > now - self.frame_s / 2)).any())


class Gather:
    """Steps that take the frames due within their own duration, under load.

    A moshi step costs about the same for the rows holding a frame as for its whole
    bucket (every row up to the highest live one: docs/moshi-engine.md), so stepping at
    once whatever is pending splits paced sessions into cohorts: at 512 Hibiki-Zero
    sessions, 2.3 steps a frame period of about 239 rows each, the GPU busy all the time
    and a frame period's work costing two and a third steps. A frame that comes while a
    step runs waits for the end of that step, then for a whole step of its own; waiting
    for it up to one step's duration before the next step instead costs it nothing and
    the frames already there at most that long, and the next step takes both cohorts.

    So after a step of duration ``d``, the next one waits until ``w`` after it ended, and no
    longer than some open session without a pending frame is due on its schedule
    (:meth:`SlotBatcher.expected_by`). A frame then waits between ``d`` and ``2d + w`` for
    its answer (at once: ``d`` and ``2d``), so a session that began on an idle engine, its
    first answer after ``d``, sees later ones up to ``d + w`` later: ``w`` is ``d`` but at
    most ``period - d - MARGIN``, which keeps that under a frame (an underrun, with a
    playback buffer of one frame). The steps a frame period fall from about ``period / d``
    to about ``period / (d + w)`` (tests/test_step_clock.py simulates both). Below
    ``FLOOR`` of a frame a step is cheap: it steps at once, as before, and latency under
    light load does not move.
    """

    #: Share of the frame period a step must take (recently) before steps wait.
    FLOOR = 0.25
    #: What a session's answers may come later than its first one's without an underrun
    #: (a frame, 80 ms), kept back for the senders' own lateness and the steps' spread.
    MARGIN = 0.020
    #: Weight of the newest step in the recent step time.
    SMOOTHING = 0.2

    def __init__(self, period_s: float) -> None:
        self.period = period_s
        self.step_s = 0.0  # recent step duration
        self.deadline = -math.inf  # the latest a step may wait for, set as the one before ends

    def stepped(self, started: float, ended: float) -> None:
        """A step ran from ``started`` to ``ended`` (``time.monotonic()``)."""
        duration = ended - started
        self.step_s = duration if not self.step_s else self.step_s + self.SMOOTHING * (duration - self.step_s)
        window = min(self.step_s, self.period - self.step_s - self.MARGIN)
        loaded = self.step_s >= self.FLOOR * self.period
        self.deadline = ended + window if loaded and window > 0 else -math.inf

    def wait(self, now: float, batcher: SlotBatcher) -> float:
        """0: step now; else wait at most this long (a frame that comes may end it sooner)."""
        if now >= self.deadline or not batcher.expected_by(self.deadline, now):
            return 0.0
        return self.deadline - now


class StepClock:
    """Engine steps on a fixed clock of one frame, each serving every session with a frame.

    A model step costs about the same for half the sessions as for all of them (the
    moshi engine always runs the full batch and masks the rows without a frame), so
    stepping whenever any frame is pending splits the sessions into cohorts stepped
    apart and keeps the GPU busy at any load, with nothing left for a slow step. On
    the clock, each tick steps the frames due at least ``SLACK_S`` before it; a
    session's frames therefore always wait the same time for their tick, up to one
    period (half on average) plus the slack, whoever joins or leaves: latency, but no
    jitter. The grid keeps its phase for good. A frame still waiting after the tick it
    was due for (its slot was behind, or it came late) is stepped at once, in a
    catch-up step of such frames only.
    """

    def __init__(self, period_s: float) -> None:
        self.period = period_s
        self.next = math.nan  # the next tick; set by the first decision
        self.last = -math.inf  # the last tick
        self.catch_up = False  # whether the last decision to step was a catch-up

    def decide(self, now: float, oldest_due: float) -> tuple[float, float]:
        """``(wait, cutoff)``: wait this long, or (0) step now the frames due by ``cutoff``."""
        if self.next != self.next:  # nan: the grid starts here
            self.next = now
        if now >= self.next:  # a tick (the latest grid point, if steps ran long)
            self.last = self.next + self.period * ((now - self.next) // self.period)
            self.next = self.last + self.period
            self.catch_up = False
            return 0.0, self.last - SLACK_S
        if oldest_due <= self.last - SLACK_S:  # a frame missed its tick: catch up
            self.catch_up = True
            return 0.0, self.last - SLACK_S
        return self.next - now, 0.0


class FifoBatcher:
    """:class:`SlotBatcher` for stepping at once (no clock): every slot holding a frame
    gives its oldest. Per-slot deques and a dict of the slots that hold frames: a push is
    a few list operations, not numpy's scalar indexing, and a gather passes over those
    slots only (``duplexserve bench bridge-cost``; docs/benchmarks.md)."""

    arrived_past_due = 0.0  # no clock: nothing is due

    def __init__(self, num_slots: int, window: int) -> None:
        self.window = window
        self._fifo: list[collections.deque[np.ndarray]] = [collections.deque() for _ in range(num_slots)]
        self._generation = [-1] * num_slots
        self._ready: dict[int, None] = {}  # the slots holding frames
        self.pending = 0  # frames held over all slots

    def open(self, slot: int, generation: int) -> None:
        self.close(slot)
        self._generation[slot] = generation

    def close(self, slot: int) -> None:
        fifo = self._fifo[slot]
        self.pending -= len(fifo)
        fifo.clear()
        self._ready.pop(slot, None)
        self._generation[slot] = -1

    def held(self, slot: int) -> int:
        """Frames of ``slot`` waiting for a step."""
        return len(self._fifo[slot])

    def push(self, slot: int, generation: int, frame: np.ndarray, now: float = 0.0) -> bool:
        """As :meth:`SlotBatcher.push` (``now`` unused)."""
        if self._generation[slot] != generation:
            return True
        fifo = self._fifo[slot]
        if len(fifo) >= self.window:
            return False
        fifo.append(frame)
        self._ready[slot] = None
        self.pending += 1
        return True

    def gather(
        self, cutoff: float = math.inf, out: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As :meth:`SlotBatcher.gather`, slots in ascending order (``cutoff`` unused)."""
        fifo, generation = self._fifo, self._generation
        slots = sorted(self._ready)
        pending = [fifo[s].popleft() for s in slots]
        self._ready = {s: None for s in slots if fifo[s]}
        self.pending -= len(slots)
        generations = np.array([generation[s] for s in slots], np.int64)
        return np.array(slots, np.int64), generations, _batch(pending, out)
