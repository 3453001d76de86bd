"""A session's prompt (a text and a voice: PersonaPlex) as every protocol carries it.

Each protocol brings a session's prompt its own way (docs/protocols.md): the native
query or first ``session.update``, Kyutai's ``/api/chat`` query, Realtime's
``instructions`` and output voice, Twilio's custom parameters. What they share is here:
the prompt's fields, and what a refusal from ``Orchestrator.run_prompt`` means for the
session (docs/protocol.md: ``prompt_unsupported`` goes on, the others end it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from duplexserve import errors
from duplexserve.errors import SessionError

PROMPT_KEYS = ("text_prompt", "voice_prompt")
#: The close that follows a refused prompt; ``prompt_unsupported`` has none (the session
#: goes on without it). ``invalid_prompt`` is bad input in the request: docs/protocol.md's 1007.
_CLOSE_CODES = {
    "voice_not_found": errors.POLICY,
    "invalid_prompt": errors.INVALID_PAYLOAD,
    "engine_error": errors.INTERNAL,
}
OUTCOMES = ("ran", "prompt_unsupported", "voice_not_found", "invalid_prompt", "engine_error")


def prompt_of(fields: Mapping[str, Any]) -> dict[str, str] | None:
    """The prompt among ``fields`` (a query, an event): its non-empty fields, or None when it
    sets none. Raises ValueError naming a field that is not a string."""
    prompt = {}
    for key in PROMPT_KEYS:
        value = fields.get(key)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise ValueError(f"'{key}' must be a string")
        prompt[key] = value
    return prompt or None


def refusal(code: str, message: str) -> SessionError:
    """A refused prompt as the error the client gets: fatal unless ``prompt_unsupported``."""
    close = None if code == "prompt_unsupported" else _CLOSE_CODES.get(code, errors.INTERNAL)
    return SessionError(code, message, close)
