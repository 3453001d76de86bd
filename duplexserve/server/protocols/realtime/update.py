"""Realtime's ``session.update``: formats, voice, instructions and turn detection, validated
before any change; for a model that takes prompts, its prompt (docs/protocols.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from duplexserve.codecs.formats import FormatError
from duplexserve.errors import SessionError
from duplexserve.server.core import prompts
from duplexserve.server.core.session import State
from duplexserve.server.protocols.realtime import events as ev

DEFAULT_VOICE = "default"  # no voice prompt
_TURN_DETECTION_KEYS = {
    "type",
    "threshold",
    "prefix_padding_ms",
    "silence_duration_ms",
    "create_response",
    "interrupt_response",
    "idle_timeout_ms",
    "eagerness",
}


class ClientEventError(Exception):
    """A client event the server cannot take: an ``error`` event, the session goes on."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param



@dataclass(slots=True)
class _Apply:
    """Work for the writer, in order with output: returns the events to send."""

    run: Callable[[], list[dict[str, Any]]]


class SessionUpdate:
    """Mixed into :class:`~duplexserve.server.protocols.realtime.adapter.RealtimeConnection`."""

    state: dict[str, Any]
    responses: Any
    session: Any
    orch: Any
    decoder: Any
    encoder: Any
    _prompted: bool
    _after_prompt: Callable[[], list[dict[str, Any]]] | None
    _codecs: Any
    _apply: Any
    run_prompt: Any

    async def update_session(self, event: dict[str, Any], client_event_id: str | None) -> SessionError | None:
        """``session.update``, and the model's prompt when it sets one (``session.updated``
        once the prompt ran; what the client sent after it waits until then). Returns the
        refusal that ended the session, if one did."""
        prompt = self._update(event, client_event_id)
        if prompt is None:
            return None
        session = self.session
        assert session is not None
        refused = await self.run_prompt(prompt)
        if refused is not None and refused.code == "voice_not_found":  # in Realtime's own term
            refused = prompts.refusal(refused.code, f"voice {prompt['voice_prompt']!r} is not one of this "
                                       "server's voices: GET /v1/voices lists them (its --voice-prompt-dir)")
        if refused is not None:
            session.error(refused)
            if refused.fatal:
                return refused
        apply, self._after_prompt = self._after_prompt, None
        if apply is not None:
            self._apply(apply)
        return None

    def _update(self, event: dict[str, Any], client_event_id: str | None) -> dict[str, str] | None:
        """GA nested ``audio.input.format`` and beta flat fields, validated before any change.
        Returns the prompt to run when the update sets the model's (``update_session`` runs
        it, then says ``session.updated``); None: ``session.updated`` is queued."""
        spec = event.get("session")
        if not isinstance(spec, dict):
            raise ClientEventError("invalid_value", "'session' must be an object", "session")
        if spec.get("type", "realtime") != "realtime":
            raise ClientEventError(
                "unsupported_session_type", "only session.type 'realtime' is supported", "session.type"
            )
        state = dict(self.state)
        audio = _object(spec, "audio", "session.audio")
        side_in = _object(audio, "input", "session.audio.input")
        side_out = _object(audio, "output", "session.audio.output")
        for key, side, beta in (
            ("input_format", side_in, "input_audio_format"),
            ("output_format", side_out, "output_audio_format"),
        ):
            if "format" in side:
                state[key] = _ga_format(side["format"], f"session.audio.{key.split('_')[0]}.format")
            elif beta in spec:
                name = spec[beta]
                if name not in ev.BETA_FORMATS:
                    raise ClientEventError(
                        "invalid_value",
                        f"{beta} must be one of {', '.join(ev.BETA_FORMATS)}",
                        f"session.{beta}",
                    )
                state[key] = ev.BETA_FORMATS[name]
        voice = side_out.get("voice", spec.get("voice"))
        if isinstance(voice, dict):
            voice = voice.get("id")
        if voice is not None:
            if not isinstance(voice, str):
                raise ClientEventError(
                    "invalid_value", "voice must be a string", "session.audio.output.voice"
                )
            state["voice"] = voice
        if "instructions" in spec:
            if not isinstance(spec["instructions"], str):
                raise ClientEventError(
                    "invalid_value", "instructions must be a string", "session.instructions"
                )
            state["instructions"] = spec["instructions"]
        for holder, param in (
            (side_in, "session.audio.input.turn_detection"),
            (spec, "session.turn_detection"),
        ):
            if "turn_detection" in holder:
                state["turn_detection"] = _turn_detection(holder["turn_detection"], param)
                break
        prompt = self._prompt_of(state)
        try:
            decoder, encoder = self._codecs(state["input_format"], state["output_format"])
        except FormatError as exc:
            raise ClientEventError("unsupported_format", str(exc), "session.audio") from None
        if state["input_format"] != self.state["input_format"]:
            self.decoder = decoder  # input side: from the next append on
        self.state = state
        snapshot = ev.session_object(state)
        change_output = state["output_format"] != self.responses.output_format

        def apply() -> list[dict[str, Any]]:  # output side: between the frames around it
            if change_output:
                self.encoder = encoder
            self.responses.output_format = state["output_format"]
            self.responses.voice = state["voice"]
            return [{"type": "session.updated", "session": snapshot}]

        if prompt is not None:
            self._prompted, self._after_prompt = True, apply
            return prompt
        self._apply(apply)
        return None

    def _prompt_of(self, state: dict[str, Any]) -> dict[str, str] | None:
        """The prompt of a model that takes one when ``state`` changes its instructions or
        voice, else None. Set once, before any audio (audio first: the default prompt ran)."""
        if not self.orch.engine.takes_prompts:
            return None  # echoed, not applied: agent frameworks always send them
        changed = [key for key in ("instructions", "voice") if state[key] != self.state[key]]
        if not changed:
            return None
        assert self.session is not None
        if self._prompted or self.session.state is not State.CREATED:
            raise ClientEventError(
                "session_locked",
                "instructions and voice are the model's prompt, set once before the first audio",
                "session.instructions" if changed[0] == "instructions" else "session.audio.output.voice",
            )
        prompt = {"text_prompt": state["instructions"]}
        if state["voice"] != DEFAULT_VOICE:
            prompt["voice_prompt"] = state["voice"]
        return prompt


def _object(holder: dict[str, Any], key: str, param: str) -> dict[str, Any]:
    value = holder.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ClientEventError("invalid_value", f"{param} must be an object", param)
    return value


def _ga_format(spec: Any, param: str) -> str:
    if not isinstance(spec, dict) or spec.get("type") not in ev.GA_FORMATS:
        raise ClientEventError(
            "invalid_value", f"{param}.type must be one of {', '.join(ev.GA_FORMATS)}", param
        )
    if spec["type"] == "audio/pcm" and spec.get("rate", 24000) != 24000:
        raise ClientEventError("invalid_value", "audio/pcm is 24000 Hz only", param + ".rate")
    return spec["type"]


def _turn_detection(spec: Any, param: str) -> dict[str, Any] | None:
    """Stored and echoed, not acted on: the model takes turns by itself (docs/protocols.md)."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") not in ("server_vad", "semantic_vad"):
        raise ClientEventError(
            "invalid_value", "turn_detection is null or of type server_vad or semantic_vad", param
        )
    return {k: v for k, v in spec.items() if k in _TURN_DETECTION_KEYS}
