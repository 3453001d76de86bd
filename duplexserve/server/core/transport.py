"""What a protocol adapter may ask of the transport that carries it, and nothing more.

Two axes meet in a connection: the transport moves messages (the WebSocket, on the fast
path or over ASGI; a WebRTC call: data channel and media track) and the protocol gives them
meaning (server/protocols/). A protocol adapter (core/adapter.py) holds its transport
through this interface, composed, not inherited, so a protocol does not know which
transport carries it and a transport does not know the protocol.

Arrivals go the other way: the transport drives the adapter. It calls ``adapter.open()``
(the protocol's handshake), then hands every message to ``adapter.receive(data)`` (or, on a
fast path, ``adapter.receive_now(data)`` first), audio that came on a media track straight to
the session followed by ``adapter.received(session)``, and sends the session's outgoing
items with ``adapter.send_item(item)`` (or ``adapter.render_now(item)``); ``adapter.finish()``
when the connection ends.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Transport(Protocol):
    #: The request that made the connection, ASGI-shaped: ``path``, ``headers``,
    #: ``query_string``, ``client``.
    scope: dict[str, Any]
    #: True: audio goes on the transport's own media track (``send_audio``), not in messages.
    media: bool

    async def accept(self, subprotocol: str | None = None) -> None:
        """Accept the connection (the WebSocket upgrade); before it only ``refuse``."""

    async def receive(self) -> bytes | str | None:
        """The next message, before the session streams (Twilio waits for its ``start``);
        None: the client is gone."""

    async def send_bytes(self, data: bytes) -> None: ...

    async def send_text(self, text: str) -> None: ...

    async def close(self, code: int, reason: str = "") -> None: ...

    def send_bytes_now(self, data: bytes | memoryview) -> None:
        """Send at once, no await: only from ``render_now`` and ``send_encoded``, which the
        transport calls where such sends exist (the WebSocket fast path)."""

    def send_text_now(self, text: str) -> None: ...

    async def refuse(self, code: int, error: str, message: str) -> bool:
        """Refuse the connection the transport's own way (an HTTP answer); False: the
        adapter says why in its protocol's form, then closes."""

    def opened(self, outcome: tuple[int, str, str] | None) -> None:
        """What the handshake came to: None (the session is open), or (HTTP status, error,
        message) for a transport that answers over HTTP (WebRTC's offer)."""

    def send_audio(self, audio: np.ndarray) -> None:
        """Model-rate samples onto the media track (``media`` transports only)."""

    def audio_counts(self) -> dict[str, int]:
        """What the media track did with the network's packets (``media`` transports)."""

    def replaced(self) -> None:
        """A resume took this connection's session: stop moving its data at once."""
