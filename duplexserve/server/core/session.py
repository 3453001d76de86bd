"""The session core: pure state, no sockets, no threads, no clock of its own.

Model-rate samples go in with :meth:`Session.receive_audio`, 80 ms frames come out
toward the engine with :meth:`Session.frames_ready`, engine answers go in with
:meth:`Session.deliver`, and :meth:`Session.pop_outgoing` hands what the client must
get, in order, to whichever adapter owns the socket. Every protocol adapter and every
test drives this same object, the way ``websockets`` drives its sans-I/O ``Protocol``.

Counting: ``frames_in`` are whole input frames accepted, ``frames_out`` the answers
queued toward the client, ``frames_tail`` those of them that follow ``input.end`` (the
model finishing its answer on silence: the engine's ``Tail``). At the close,
``frames_dropped = frames_in - (frames_out - frames_tail)``, the input frames never
answered, so nothing is lost without being counted.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from duplexserve import errors
from duplexserve.codecs.formats import FRAME_SAMPLES
from duplexserve.engine_bridge.engine import NO_TAIL, Tail
from duplexserve.errors import SessionError
from duplexserve.server.core.events import AudioOut, ClosedOut, ErrorOut, Notice, Outgoing, TextOut
from duplexserve.server.core.turnaround import FrameTimer


class State(enum.Enum):
    CREATED = "created"  # formats may still change
    STREAMING = "streaming"  # audio has arrived; formats are fixed
    ENDING = "ending"  # input.end: answering what was accepted, then closing
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class Limits:
    inflight_frames: int = 8  # handed to the engine and not yet answered
    max_pending_frames: int = 64  # cut but not yet handed over; reading pauses past it
    max_output_frames: int = 256  # answered but not yet taken by the socket writer
    max_tail_frames: int = 125  # after input.end, a model finishing on its own: at most (10 s)
    max_output_event_bytes: int = 4 << 20  # replies and errors not yet taken by the writer (estimated)


#: What one queued reply or error is counted as beyond the message it answers.
EVENT_BYTES = 64


#: The tail's input: silence, one read-only frame shared by every session.
SILENCE = np.zeros(FRAME_SAMPLES, dtype=np.float32)
SILENCE.flags.writeable = False


def no_notify() -> None:
    """A session nobody is connected to (not yet, or detached): nothing to wake."""


class Session:
    def __init__(
        self, session_id: str, slot: int, generation: int, limits: Limits, timer: FrameTimer | None = None
    ) -> None:
        self.id = session_id
        self.slot = slot
        self.generation = generation
        self.limits = limits
        self.state = State.CREATED
        self.frames_in = 0
        self.frames_out = 0
        self.inflight = 0
        self.closed_event: ClosedOut | None = None
        self.started = 0.0  # set by whoever owns the clock
        self.last_activity = 0.0  # also the receive time of the message being fed in
        #: No connection holds the session; it waits for a resume (server/core/resume.py).
        self.detached = False
        #: Times every frame's turnaround; fed the receive time of each message with a frame.
        self.timer = timer
        #: ``FrameTimer.arrived`` without the Python call: the list's own extend.
        self._arrived = timer.arrivals.extend if timer is not None else None
        #: Called after the session queued something or freed room; the adapter wakes on it.
        self.notify: Callable[[], None] = no_notify
        #: How long to wait after the last answer before closing ``completed``: for an engine
        #: whose text for a frame may come after the frame (vLLM-Omni). 0: close at once.
        self.completion_grace_s = 0.0
        #: Every frame is answered after input.end; whoever owns the clock closes it after
        #: the grace (``Orchestrator.pump``).
        self.complete_due = False
        #: What the engine needs after input.end (set at open); ``end_due``: the engine is
        #: still to be told that the input ended (a tail that runs until the model is done).
        self.tail: Tail = NO_TAIL
        self.end_due = False
        self._tail_left = 0  # tail frames still to hand to the engine
        self._tail_pushed = 0
        self._partial = np.zeros(0, dtype=np.float32)
        self._pending: collections.deque[np.ndarray] = collections.deque()
        self._out: collections.deque[Outgoing] = collections.deque()
        self._queued_frames = 0
        #: The size of the client message being handled, set by the adapter around it: a
        #: reply to it (a pong, an error) echoes at most that much of it.
        self.reply_cost = 0
        self._event_costs: collections.deque[int] = collections.deque()  # of queued Notice/ErrorOut
        self._event_bytes = 0

    # ----------------------------------------------------------------- input side
    @property
    def accepts_audio(self) -> bool:
        return self.state in (State.CREATED, State.STREAMING)

    @property
    def closed(self) -> bool:
        return self.state is State.CLOSED

    @property
    def frames_tail(self) -> int:
        """Answers past the last input frame: input.end's tail (output i answers input i)."""
        return max(0, self.frames_out - self.frames_in)

    @property
    def frames_waiting(self) -> bool:
        """Frames cut and not yet handed to the engine (a move waits for none: core/move.py)."""
        return bool(self._pending)

    @property
    def input_paused(self) -> bool:
        """True while the reader should stop reading: the engine is not keeping up."""
        return len(self._pending) >= self.limits.max_pending_frames

    def receive_audio(self, samples: np.ndarray) -> int:
        """Cut model-rate float32 samples into frames; returns how many whole frames."""
        if not self.accepts_audio:
            if self.state is State.ENDING:
                raise SessionError("input_ended", "audio after input.end was not accepted")
            return 0
        self.state = State.STREAMING
        partial = self._partial
        if len(samples) == FRAME_SAMPLES and not len(partial):  # the common case: one frame
            self._pending.append(samples)
            self.frames_in += 1
            if self._arrived is not None:
                self._arrived((self.frames_in, self.last_activity))
            return 1
        if not len(samples):
            return 0
        count = self._cut(samples, partial)
        if count and self._arrived is not None:
            self._arrived((self.frames_in, self.last_activity))
        return count

    def _cut(self, samples: np.ndarray, partial: np.ndarray) -> int:
        if len(partial):
            need = FRAME_SAMPLES - len(partial)
            if len(samples) < need:
                self._partial = np.concatenate((partial, samples))
                return 0
            self._push(np.concatenate((partial, samples[:need])))
            samples = samples[need:]
            count = 1
        else:
            count = 0
        whole = len(samples) // FRAME_SAMPLES
        if whole:
            frames = samples[: whole * FRAME_SAMPLES].reshape(whole, FRAME_SAMPLES)
            self._pending.extend(frames)  # views of the received buffer: no copy
            self.frames_in += whole
            count += whole
        rest = len(samples) - whole * FRAME_SAMPLES
        self._partial = samples[whole * FRAME_SAMPLES :].copy() if rest else samples[:0]
        return count

    def _push(self, frame: np.ndarray) -> None:
        self._pending.append(frame)
        self.frames_in += 1

    def end_input(self) -> None:
        """No more audio: pad the partial frame with silence, answer all, then close."""
        if not self.accepts_audio:
            return
        if len(self._partial):
            frame = np.zeros(FRAME_SAMPLES, dtype=np.float32)
            frame[: len(self._partial)] = self._partial
            self._partial = self._partial[:0]
            self._push(frame)
            if self._arrived is not None:
                self._arrived((self.frames_in, self.last_activity))
        self.state = State.ENDING
        tail = self.tail
        self._tail_left = self.limits.max_tail_frames if tail.until_done else tail.frames
        self.end_due = tail.until_done
        self._maybe_complete()

    def drop_partial(self) -> None:
        """After a resume the client sends again from input frame ``frames_in``: forget
        the samples of a frame it had only begun."""
        self._partial = self._partial[:0]

    def frames_ready(self) -> list[np.ndarray]:
        """Frames the engine may take now, oldest first, within the in-flight window."""
        room = self.limits.inflight_frames - self.inflight
        pending = self._pending
        if not pending and self._tail_left and not self.closed:
            self._push_tail(room)
        if room <= 0 or not pending or self.closed:
            return []
        if room >= len(pending):
            ready = list(pending)
            pending.clear()
        else:
            ready = [pending.popleft() for _ in range(room)]
        self.inflight += len(ready)
        return ready

    def _push_tail(self, room: int) -> None:
        """After input.end and every input frame handed over: silence for the tail, one
        frame at a time while the model may end its answer at any step (each answer says
        whether it did), else as many as the window takes."""
        count = int(self.inflight == 0) if self.tail.until_done else min(room, self._tail_left)
        for _ in range(count):
            self._pending.append(SILENCE)
        self._tail_left -= count
        self._tail_pushed += count

    def unready(self, frames: list[np.ndarray]) -> None:
        """Take back frames the engine could not take yet; they go first next time."""
        self._pending.extendleft(reversed(frames))
        self.inflight -= len(frames)

    # ---------------------------------------------------------------- output side
    def deliver(self, audio: np.ndarray, text: str | None = None, finished: bool = False) -> None:
        """The engine's answer to the oldest frame in flight; ``finished``: the model ended
        its answer with it (after input.end, no more tail)."""
        if self.closed:
            return
        self.inflight -= 1
        index = self.frames_out
        self.frames_out += 1
        if finished:
            self._tail_left = 0
        self._out.append(AudioOut(index, audio))
        self._queued_frames += 1
        if text:
            self._out.append(TextOut(index, text))
        if self._queued_frames > self.limits.max_output_frames:
            self.close("slow_consumer", errors.POLICY)
            return
        if self.state is State.ENDING:
            self._maybe_complete()

    def deliver_text(self, text: str) -> None:
        """Text for the frame that last went out: an engine that sends a unit's text after
        its audio (vLLM-Omni) may see the frame leave first (``completion_grace_s`` keeps a
        finished session open for the last frame's)."""
        if not self.closed:
            self._out.append(TextOut(max(self.frames_out - 1, 0), text))

    def _maybe_complete(self) -> None:
        every = self.frames_in + self._tail_pushed
        if self.frames_out == every and not self._pending and not self._tail_left:
            if self.completion_grace_s:
                self.complete_due = True
            else:
                self.close("completed", errors.NORMAL)

    def say(self, payload: object) -> None:
        """Queue a protocol-specific message in order with audio."""
        if not self.closed:
            self._queue_event(Notice(payload))

    def error(self, exc: SessionError) -> None:
        """Report bad input; a fatal error also closes the session with its code."""
        if self.closed:
            return
        self._queue_event(ErrorOut(exc.code, exc.message, exc.fatal))
        if exc.close_code is not None and not self.closed:
            self.close(exc.code, exc.close_code)

    def _queue_event(self, item: Notice | ErrorOut) -> None:
        """Replies are bounded like audio: a client that sends what gets a reply and reads
        nothing would otherwise grow them without end (as audio, ``slow_consumer``)."""
        cost = self.reply_cost + EVENT_BYTES
        self._out.append(item)
        self._event_costs.append(cost)
        self._event_bytes += cost
        if self._event_bytes > self.limits.max_output_event_bytes:
            self.close("slow_consumer", errors.POLICY)

    def close(self, reason: str, close_code: int) -> None:
        """End now. Frames not answered by this point are counted as dropped."""
        if self.closed:
            return
        ended_input = self.state is State.ENDING
        self.state = State.CLOSED
        self._pending.clear()
        self._tail_left = 0
        answered = self.frames_out - self.frames_tail
        tail = self.frames_tail if ended_input and self.tail != NO_TAIL else None
        self.closed_event = ClosedOut(
            reason, close_code, self.frames_in, self.frames_out, self.frames_in - answered, tail
        )
        self._out.append(self.closed_event)

    def pop_outgoing(self) -> Outgoing | None:
        if not self._out:
            return None
        item = self._out.popleft()
        cls = item.__class__
        if cls is AudioOut:
            self._queued_frames -= 1
        elif cls is Notice or cls is ErrorOut:
            self._event_bytes -= self._event_costs.popleft()
        return item

    @property
    def has_outgoing(self) -> bool:
        return bool(self._out)
