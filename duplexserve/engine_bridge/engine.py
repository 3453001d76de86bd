"""The seam between the frontend and a model: fixed slots, one batched step per frame.

An engine knows nothing of sockets, sessions or threads. It is driven from one
thread (the engine thread), so it needs no locks of its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class StepResult:
    """One output frame per row of the batch, plus text tokens for some rows."""

    audio: np.ndarray  # (batch, 1920) float32 at 24 kHz
    text: dict[int, str] = field(default_factory=dict)  # batch row -> text token
    #: Rows whose answer ended with this frame (after ``end_input``: a translation model
    #: sampled its end of text); None when none did.
    finished: list[int] | None = None
    #: Rows whose output could not be rendered (a text piece the tokenizer raised on): their
    #: sessions end with ``internal_error``, the others' outputs of the step go out as usual.
    failed: list[int] | None = None
    #: Calls whose KV context stopped growing at this step for want of memory (paged KV): they go
    #: on at the context they hold (docs/moshi-engine.md, Paged KV).
    kv_stops: int = 0


@dataclass(frozen=True, slots=True)
class Tail:
    """What an engine's model needs after ``input.end`` to finish its answer (docs/protocol.md).

    ``frames`` frames of silence (a dialogue model answers ``delay`` frames late, so the
    answer to the last input frame needs that many more steps), or, with ``until_done``,
    silence until a step reports the row finished (a translation model's end of text),
    at most ``--drain-max-s``.
    """

    frames: int = 0
    until_done: bool = False


NO_TAIL = Tail()


class PromptError(ValueError):
    """A session's prompt refused, with docs/protocol.md's error code: ``prompt_unsupported``
    (the model takes none; the session goes on without it), ``voice_not_found`` (fatal,
    1008), ``invalid_prompt`` (one that does not fit the model)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class MoveRefused(ValueError):
    """A slot's state that cannot be exported or imported, with a stable ``code``:
    ``move_unsupported`` (this engine keeps no movable state), ``move_not_now`` (the slot is
    mid-prompt, say: try again later), ``move_mismatch`` (the state comes from another model,
    shape or version), ``move_corrupt`` (it does not parse)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Engine(ABC):
    """A model that owns the streaming state of ``num_slots`` sessions."""

    name: str = "engine"
    frame_samples: int = 1920
    #: Known once ``start`` returned: what ``input.end`` takes (``Tail``).
    tail: Tail = NO_TAIL
    #: (num_slots x frame_samples) float32 that the bridge may gather a step's frames into
    #: and pass as ``frames`` (its first rows): an engine whose step copies its input into
    #: a buffer of its own offers that buffer and skips the copy. None: a new array a step.
    #: An engine offering it must not return views of it (the next step overwrites it).
    input_buffer: np.ndarray | None = None
    #: Known once ``start`` returned: whether sessions take a prompt (PersonaPlex: a text
    #: and a voice, run before their first frame), and the voices they may name.
    takes_prompts: bool = False
    voices: tuple[str, ...] = ()
    #: How long the last step's answer waited for the GIL before the engine thread ran on
    #: (measured by an engine in its own process: engine_bridge/process_engine.py); 0: unknown.
    gil_wait_s: float = 0.0

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots

    def start(self) -> None:  # noqa: B027 - optional hook
        """Load weights, allocate state, warm up. Runs on the engine thread."""

    def alive(self) -> bool:
        """False once the engine cannot go on (its process died): the bridge then ends
        every session it held and starts it again. Checked when idle and after a failure."""
        return True

    def warm(self) -> bool:
        """Do one piece of the start-up work left for later (a bucket's CUDA graphs); the
        bridge calls it while no session is open. True while more remains."""
        return False

    @abstractmethod
    def open(self, slot: int, params: dict[str, Any]) -> None:
        """Give ``slot`` a fresh state for a new session."""

    @abstractmethod
    def close(self, slot: int) -> None:
        """The session in ``slot`` is gone; its state may be dropped."""

    def prompt(self, slot: int, params: dict[str, Any]) -> None:
        """Run the prompt of ``params`` (``text_prompt``, ``voice_prompt``) for the session
        just opened in ``slot``, before its first frame; ``PromptError`` says why not. An
        engine that takes prompts runs a default one for a session stepped without."""
        raise PromptError("prompt_unsupported", f"the {self.name} engine's model takes no prompt")

    def prompt_cached(self, params: dict[str, Any]) -> bool:
        """Whether ``prompt(slot, params)`` is cheap now (run before, or refused at once)."""
        return True

    def end_input(self, slot: int, frames: int) -> None:  # noqa: B027 - optional hook
        """The input of ``slot`` ended after ``frames`` frames; what follows is its tail.
        An engine whose model is told of the end (Hibiki: one end-of-input frame) does so
        at frame index ``frames``, whenever that frame comes."""

    @abstractmethod
    def step(self, slots: np.ndarray, frames: np.ndarray) -> StepResult:
        """Advance the sessions in ``slots`` (int array) by one frame each.

        ``frames`` is (len(slots), frame_samples) float32; row i belongs to slots[i].
        """

    def export_slot(self, slot: int) -> bytes:
        """Everything ``slot``'s session has built in the model, as bytes that ``import_slot``
        of another replica serving the same model takes (live migration, docs/protocol.md).
        Called on the engine thread between steps, once every frame submitted for the slot
        has been stepped; the slot stays open (the caller closes it once the move landed)."""
        raise MoveRefused("move_unsupported", f"the {self.name} engine cannot export a session")

    def import_slot(self, slot: int, state: bytes) -> None:
        """Open ``slot`` with a state ``export_slot`` made (instead of ``open``): its next step
        goes on exactly where the exported session's last one ended. ``MoveRefused`` if the
        state is not this model's (``move_mismatch``) or does not parse (``move_corrupt``)."""
        raise MoveRefused("move_unsupported", f"the {self.name} engine cannot import a session")

    def stop(self) -> None:  # noqa: B027 - optional hook
        """Release resources. Runs on the engine thread."""

    def discard(self) -> None:
        """Stop after a failure, ``start()`` to follow: what a restart can reuse may stay."""
        self.stop()
