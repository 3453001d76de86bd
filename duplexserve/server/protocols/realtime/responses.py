"""How a model that speaks continuously maps onto OpenAI Realtime responses.

Pure state, no I/O, driven frame by frame by the Realtime adapter's writer:

- **idle**: output frames are silent and not sent. The first voiced frame (RMS above
  the speech threshold) opens a response; text the model emitted just before it (Moshi's
  text leads its audio) becomes the first transcript delta.
- **speaking**: every frame is sent as ``response.output_audio.delta``, silent ones
  included. ``silence_frames`` silent frames in a row end the response with status
  ``completed``.
- **muted**: after ``response.cancel``, the response ends at once with status
  ``cancelled`` and the rest of that stretch of speech is dropped until the model has
  been silent for ``silence_frames`` frames.

``response.create`` opens a response at once (so clients that wait for
``response.created`` get it); it then follows the same rules. Every event of one
response comes in the order clients check: ``response.created``,
``response.output_item.added``, ``conversation.item.added``,
``response.content_part.added``, deltas, the ``.done`` events, ``response.done``.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from duplexserve.codecs.formats import FRAME_MS
from duplexserve.server.protocols.realtime import events as ev

Event = dict[str, Any]


class Mode(enum.Enum):
    IDLE = "idle"
    SPEAKING = "speaking"
    MUTED = "muted"


@dataclass(slots=True)
class Response:
    id: str
    item_id: str
    metadata: dict[str, Any] | None
    frames: int = 0
    transcript: list[str] = field(default_factory=list)

    def where(self) -> Event:
        return {"response_id": self.id, "item_id": self.item_id, "output_index": 0, "content_index": 0}


class Responses:
    def __init__(self, new_id: Callable[[str], str], silence_frames: int, max_items: int = 256) -> None:
        self.new_id = new_id
        self.silence_frames = max(1, silence_frames)
        self.conversation_id = new_id("conv")
        self.output_format = "audio/pcm"
        self.voice = "default"
        self.mode = Mode.IDLE
        self.current: Response | None = None
        self._silent_run = 0
        self._pending_text: list[str] = []
        self._idle_since_text = 0
        self._last_item: str | None = None
        #: Finished assistant items -> their audio length in ms, for ``conversation.item.truncate``.
        self._items: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._max_items = max_items

    # ------------------------------------------------------------ frame by frame
    def audio(self, voiced: bool) -> tuple[list[Event], Response | None, list[Event]]:
        """One output frame: events to send before it, the response it is a delta of (None:
        not sent), events to send after it."""
        mode = self.mode
        if mode is Mode.SPEAKING:
            current = self.current
            return [], current, self._count(voiced)
        if mode is Mode.MUTED:
            self._silent_run = 0 if voiced else self._silent_run + 1
            if self._silent_run >= self.silence_frames:
                self.mode = Mode.IDLE
            return [], None, []
        if not voiced:
            if self._pending_text:
                self._idle_since_text += 1
                if self._idle_since_text > self.silence_frames:
                    self._pending_text.clear()
            return [], None, []
        before = self._open(None)
        current = self.current
        return before, current, self._count(True)

    def text(self, text: str) -> list[Event]:
        if self.mode is Mode.SPEAKING:
            assert self.current is not None
            self.current.transcript.append(text)
            return [{"type": "response.output_audio_transcript.delta", **self.current.where(), "delta": text}]
        if self.mode is Mode.IDLE:
            self._pending_text.append(text)
            self._idle_since_text = 0
        return []

    def _count(self, voiced: bool) -> list[Event]:
        current = self.current
        assert current is not None
        current.frames += 1
        self._silent_run = 0 if voiced else self._silent_run + 1
        if self._silent_run >= self.silence_frames:
            self.mode = Mode.IDLE
            return self._close("completed", None)
        return []

    # ------------------------------------------------------------ client requests
    def create(self, metadata: dict[str, Any] | None, client_event_id: str | None) -> list[Event]:
        if self.mode is Mode.SPEAKING:
            return [
                ev.error(
                    "conversation_already_has_active_response",
                    "a response is in progress; cancel it first",
                    client_event_id=client_event_id,
                )
            ]
        return self._open(metadata)

    def cancel(self, response_id: str | None, client_event_id: str | None) -> list[Event]:
        current = self.current
        if self.mode is not Mode.SPEAKING or current is None or response_id not in (None, current.id):
            return [
                ev.error(
                    "response_cancel_not_active",
                    "there is no active response to cancel",
                    client_event_id=client_event_id,
                )
            ]
        self.mode = Mode.MUTED
        self._silent_run = 0
        return self._close("cancelled", "client_cancelled")

    def truncate(
        self, item_id: str, content_index: int, audio_end_ms: int, client_event_id: str | None
    ) -> list[Event]:
        current = self.current
        if current is not None and current.item_id == item_id:
            length = current.frames * FRAME_MS
        elif item_id in self._items:
            length = self._items[item_id]
        else:
            return [
                ev.error(
                    "item_not_found",
                    f"no assistant item {item_id!r}",
                    client_event_id=client_event_id,
                    param="item_id",
                )
            ]
        if content_index != 0:
            return [
                ev.error(
                    "invalid_value",
                    "content_index must be 0",
                    client_event_id=client_event_id,
                    param="content_index",
                )
            ]
        if not 0 <= audio_end_ms <= length:
            return [
                ev.error(
                    "invalid_value",
                    f"audio_end_ms must be within 0..{length}",
                    client_event_id=client_event_id,
                    param="audio_end_ms",
                )
            ]
        if item_id in self._items:
            self._items[item_id] = audio_end_ms
        return [
            {
                "type": "conversation.item.truncated",
                "item_id": item_id,
                "content_index": 0,
                "audio_end_ms": audio_end_ms,
            }
        ]

    def finish(self) -> list[Event]:
        """The session ends: a response still open ends ``incomplete``."""
        if self.mode is Mode.SPEAKING:
            self.mode = Mode.IDLE
            return self._close("incomplete", None)
        return []

    # ---------------------------------------------------------------- lifecycle
    def _open(self, metadata: dict[str, Any] | None) -> list[Event]:
        current = self.current = Response(self.new_id("resp"), self.new_id("item"), metadata)
        self.mode = Mode.SPEAKING
        self._silent_run = 0
        item = ev.assistant_item(current.item_id, "in_progress", None)
        events: list[Event] = [
            {"type": "response.created", "response": self._response("in_progress", [])},
            {
                "type": "response.output_item.added",
                "response_id": current.id,
                "output_index": 0,
                "item": item,
            },
            {"type": "conversation.item.added", "previous_item_id": self._last_item, "item": item},
            {
                "type": "response.content_part.added",
                **current.where(),
                "part": {"type": "audio", "transcript": ""},
            },
        ]
        if self._pending_text:
            text = "".join(self._pending_text)
            self._pending_text.clear()
            current.transcript.append(text)
            events.append(
                {"type": "response.output_audio_transcript.delta", **current.where(), "delta": text}
            )
        return events

    def _close(self, status: str, reason: str | None) -> list[Event]:
        current = self.current
        assert current is not None
        transcript = "".join(current.transcript)
        item = ev.assistant_item(
            current.item_id, "completed" if status == "completed" else "incomplete", transcript
        )
        where = current.where()
        details = None if status == "completed" else {"type": status, "reason": reason}
        events: list[Event] = [
            {"type": "response.output_audio.done", **where},
            {"type": "response.output_audio_transcript.done", **where, "transcript": transcript},
            {
                "type": "response.content_part.done",
                **where,
                "part": {"type": "audio", "transcript": transcript},
            },
            {"type": "response.output_item.done", "response_id": current.id, "output_index": 0, "item": item},
            {"type": "conversation.item.done", "previous_item_id": self._last_item, "item": item},
            {
                "type": "response.done",
                "response": self._response(
                    status, [item], details, ev.usage(current.frames, len(current.transcript))
                ),
            },
        ]
        self._last_item = current.item_id
        self._items[current.item_id] = current.frames * FRAME_MS
        while len(self._items) > self._max_items:
            self._items.popitem(last=False)
        self.current = None
        return events

    def _response(
        self, status: str, output: list[Event], details: Event | None = None, usage: Event | None = None
    ) -> Event:
        current = self.current
        assert current is not None
        return ev.response_object(
            current.id,
            self.conversation_id,
            status,
            output,
            self.output_format,
            self.voice,
            current.metadata,
            details,
            usage,
        )
