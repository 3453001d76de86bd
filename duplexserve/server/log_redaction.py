"""Keep keys, resume tokens, prompts and forged lines out of the server's log.

Clients put secrets where loggers print: uvicorn's request line carries the query
(``?token=``, ``?resume=``, ``?text_prompt=``), and at ``--log-level debug`` the
websockets handshake prints every header (``Authorization: Bearer ...``, the
``openai-insecure-api-key.`` subprotocol) and every frame's payload. A filter on each
logger would miss records of its children (a logger's filter sees only records logged on
it), so :func:`install` puts :class:`Redact` on every *handler*: whatever logger a record
comes from, it is redacted once before it is written. Client strings are escaped (a
newline in a value cannot start a forged log line) and each line is bounded.
"""

from __future__ import annotations

import logging
import re

#: The longest message a record may print (a request line with a 60 KB query: not 60 KB of log).
MAX_MESSAGE_CHARS = 1024
#: Query parameters whose values are kept: formats, rates and the like, never a key,
#: token or prompt. Any other parameter's value is printed as ``***``.
PLAIN_QUERY = frozenset({
    "input_format", "output_format", "input_sample_rate", "output_sample_rate", "model", "intent",
    "last_frame", "voice_prompt", "transport", "text_temperature", "text_topk", "audio_temperature",
    "audio_topk", "pad_mult", "repetition_penalty", "repetition_penalty_context", "text_seed",
    "audio_seed", "seed",
})  # fmt: skip
HIDDEN = "***"

_QUERY_PAIR = re.compile(r"([?&])([^=&\s\"']*)=([^&\s\"']*)")
_HEADER = re.compile(r"\b((?:proxy-)?authorization|cookie|x-api-key)(\s*[:=]\s*)[^\r\n]*", re.IGNORECASE)
_BEARER = re.compile(r"\b(bearer|basic)(\s+)[^\s,'\"]+", re.IGNORECASE)
_SUBPROTOCOL_KEY = re.compile(r"(openai-insecure-api-key\.)[^\s,'\"]+", re.IGNORECASE)
_CLIENT_SECRET = re.compile(r"\bek_[A-Za-z0-9_-]+")
_JSON_FIELD = re.compile(
    r"(\"(?:token|api_key|text_prompt|instructions|credential|password)\"\s*:\s*\")(?:[^\"\\]|\\.)*",
    re.IGNORECASE,
)
#: websockets' debug dump of a data frame: ``< TEXT '{"type": ...}' [123 bytes]``.
_FRAME = re.compile(r"^([<>] (?:TEXT|BINARY|CONT) ).*( \[[^\]]*\])$", re.DOTALL)
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _query_value(match: re.Match[str]) -> str:
    sep, name, value = match.groups()
    return f"{sep}{name}={value if name.lower() in PLAIN_QUERY else HIDDEN}"


def redact(text: str) -> str:
    """``text`` with every key, token and prompt it may hold replaced by ``***``."""
    text = _FRAME.sub(r"\1[payload not logged]\2", text)
    text = _QUERY_PAIR.sub(_query_value, text)
    text = _HEADER.sub(rf"\1\2{HIDDEN}", text)
    text = _BEARER.sub(rf"\1\2{HIDDEN}", text)
    text = _SUBPROTOCOL_KEY.sub(rf"\1{HIDDEN}", text)
    text = _CLIENT_SECRET.sub("ek_" + HIDDEN, text)
    return _JSON_FIELD.sub(rf"\1{HIDDEN}", text)


def _escape(char: re.Match[str]) -> str:
    return repr(char.group())[1:-1]


def one_line(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` on one line (control characters escaped) and at most about ``limit`` long."""
    if len(text) > limit:
        text = f"{text[:limit]}... [{len(text) - limit} more characters]"
    return _CONTROL.sub(_escape, text)


def clip(value: object, limit: int = 64) -> str:
    """A client-supplied string for a log line: escaped, and cut at ``limit`` characters."""
    text = str(value)
    return one_line(text[:limit]) + (f"...[{len(text)}]" if len(text) > limit else "")


class Redact(logging.Filter):
    """Rewrites each record's message redacted, escaped and bounded (never drops one)."""

    _exceptions = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "redacted", False):  # a second handler of the same record
            return True
        record.redacted = True
        if record.name == "uvicorn.access":  # its formatter reads the arguments one by one
            if isinstance(record.args, tuple):
                record.args = tuple(one_line(redact(a)) if isinstance(a, str) else a for a in record.args)
        else:
            try:
                message = record.getMessage()
            except Exception:  # a malformed call: its arguments may hold what this filter hides
                message = f"a log call whose arguments do not fit {record.msg!r}"
            record.msg, record.args = one_line(redact(message.rstrip())), None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(self._exceptions.formatException(record.exc_info))
        return True


def install() -> None:
    """:class:`Redact` on every handler configured so far (the root's, uvicorn's)."""
    redact_filter = Redact()
    loggers = [logging.getLogger(), *(
        logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    )]  # fmt: skip
    for logger in loggers:
        for handler in logger.handlers:
            if not any(isinstance(f, Redact) for f in handler.filters):
                handler.addFilter(redact_filter)
