"""Stable error codes and the WebSocket close codes of docs/protocol.md."""

from __future__ import annotations

NORMAL = 1000
GOING_AWAY = 1001
UNSUPPORTED_DATA = 1003  # audio the session cannot take
INVALID_PAYLOAD = 1007  # invalid JSON or event shape
POLICY = 1008  # authentication or policy
TOO_BIG = 1009
INTERNAL = 1011  # engine failure
SERVICE_RESTART = 1012  # the session moved to another replica: resume there (session.moved)
TRY_AGAIN = 1013  # server full or draining


class SessionError(Exception):
    """Bad input from a client: becomes an ``error`` event, and a close when fatal."""

    def __init__(self, code: str, message: str, close_code: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.close_code = close_code  # None: the session goes on

    @property
    def fatal(self) -> bool:
        return self.close_code is not None


#: A connection that names a model (``?model=``) this server does not serve: refused with
#: POLICY, never served by another model (docs/protocol.md, "Opening").
MODEL_NOT_FOUND = "model_not_found"
