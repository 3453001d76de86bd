"""OpenAI Realtime (GA) server events and session shapes, as plain dicts.

Pure functions, no I/O: the adapter stamps ``event_id`` when it sends. Shapes follow
openai-python's generated types (``openai.types.realtime``), which the tests validate
every event against; the server itself does not import the SDK.
"""

from __future__ import annotations

from typing import Any

from duplexserve.codecs.formats import MODEL_RATE, AudioFormat

#: GA ``audio.*.format.type`` and beta ``*_audio_format`` -> wire format on our side.
GA_FORMATS = {
    "audio/pcm": AudioFormat("pcm_s16le", MODEL_RATE),
    "audio/pcmu": AudioFormat("g711_ulaw", 8000),
    "audio/pcma": AudioFormat("g711_alaw", 8000),
}
BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}


def format_object(ga_type: str) -> dict[str, Any]:
    return {"type": ga_type, "rate": MODEL_RATE} if ga_type == "audio/pcm" else {"type": ga_type}


def error(
    code: str,
    message: str,
    kind: str = "invalid_request_error",
    client_event_id: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    """``error.error`` is an object: clients (pipecat) fail to parse a bare string."""
    return {
        "type": "error",
        "error": {
            "type": kind,
            "code": code,
            "message": message,
            "param": param,
            "event_id": client_event_id,
        },
    }


def session_object(state: dict[str, Any]) -> dict[str, Any]:
    """The full GA session as ``session.created`` / ``session.updated`` carry it."""
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": state["id"],
        "model": state["model"],
        "output_modalities": ["audio"],
        "instructions": state["instructions"],
        "max_output_tokens": "inf",
        "tool_choice": "auto",
        "tools": [],
        "audio": {
            "input": {
                "format": format_object(state["input_format"]),
                "transcription": None,
                "noise_reduction": None,
                "turn_detection": state["turn_detection"],
            },
            "output": {
                "format": format_object(state["output_format"]),
                "voice": state["voice"],
                "speed": 1.0,
            },
        },
    }


def assistant_item(item_id: str, status: str, transcript: str | None) -> dict[str, Any]:
    content = [] if transcript is None else [{"type": "output_audio", "transcript": transcript}]
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def response_object(
    response_id: str,
    conversation_id: str,
    status: str,
    output: list[dict[str, Any]],
    output_format: str,
    voice: str,
    metadata: dict[str, Any] | None,
    status_details: dict[str, Any] | None = None,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``object``, ``status``, ``status_details`` and ``output`` are what pipecat requires."""
    return {
        "id": response_id,
        "object": "realtime.response",
        "conversation_id": conversation_id,
        "status": status,
        "status_details": status_details,
        "output": output,
        "output_modalities": ["audio"],
        "audio": {"output": {"format": format_object(output_format), "voice": voice}},
        "max_output_tokens": "inf",
        "metadata": metadata,
        "usage": usage,
    }


def usage(audio_frames: int, text_tokens: int) -> dict[str, Any]:
    """One model frame is one audio token step (12.5 a second); input is not metered."""
    out = audio_frames + text_tokens
    return {
        "total_tokens": out,
        "input_tokens": 0,
        "output_tokens": out,
        "input_token_details": {"text_tokens": 0, "audio_tokens": 0, "cached_tokens": 0},
        "output_token_details": {"text_tokens": text_tokens, "audio_tokens": audio_frames},
    }


def audio_delta_json(event_id: str, response_id: str, item_id: str, delta_b64: str) -> str:
    """The per-frame event, written without ``json.dumps``: every field is already JSON-safe."""
    return (
        '{"type":"response.output_audio.delta","event_id":"'
        + event_id
        + '","response_id":"'
        + response_id
        + '","item_id":"'
        + item_id
        + '","output_index":0,"content_index":0,"delta":"'
        + delta_b64
        + '"}'
    )
