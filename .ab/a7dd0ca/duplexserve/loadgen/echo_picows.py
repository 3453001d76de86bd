"""The second floor: the bare echo of :mod:`duplexserve.loadgen.echo` on picows.

picows (a Cython WebSocket stack) hands each parsed frame to a callback and sends
synchronously, with no ASGI queue, event dicts or per-message pauses, and its own
frame parser and writer. It is the floor for Python WebSocket code: what a hot path
without ASGI's per-message cost could reach. It speaks the same subset of
``duplex/1`` as the uvicorn echo (``session.created``, one binary message per 80 ms
frame, ``input.end`` answered by ``session.closed``), accepts any path and query like
it, and exports the same counters on ``/metrics`` (``getrusage`` of the process), so
the two floors and duplexserve are measured alike.

picows does its own HTTP handshake: ``/metrics``, ``/health`` and ``/ready`` are
answered from its listener factory with a plain response (``Connection: close``),
which picows sends instead of the upgrade.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import signal
from typing import Any

from picows import (
    WSCloseCode,
    WSFrame,
    WSListener,
    WSMsgType,
    WSTransport,
    WSUpgradeRequest,
    WSUpgradeResponse,
    WSUpgradeResponseWithListener,
    ws_create_server,
)

from duplexserve.loadgen.echo import FRAME_BYTES, EchoApp

_HTTP_PATHS = (b"/metrics", b"/health", b"/ready")


def _created() -> str:
    fmt = {"format": "pcm_f32le", "sample_rate": 24000, "frame_samples": FRAME_BYTES // 4}
    return json.dumps({
        "type": "session.created", "protocol": "duplex/1", "session_id": secrets.token_hex(8),
        "model": "echo", "engine": "bare-echo-picows", "frame_ms": 80, "input": fmt, "output": fmt,
    })


class EchoSession(WSListener):  # type: ignore[misc]  # picows ships stubs without base types
    """One connection: every whole 80 ms frame of a binary message goes straight back."""

    def __init__(self, counters: EchoApp) -> None:
        self.counters = counters
        self.index = 0
        self.partial = b""
        self.fragments: list[bytes] = []
        self.fragment_type: WSMsgType | None = None

    def on_ws_connected(self, transport: WSTransport) -> None:
        self.counters.sessions += 1
        transport.send(WSMsgType.TEXT, _created().encode())

    def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
        kind = frame.msg_type
        if kind is WSMsgType.BINARY and frame.fin and not self.partial and frame.payload_size == FRAME_BYTES:
            self.counters.frames_in += 1  # the common case: send it straight back
            self.index += 1
            transport.send(WSMsgType.BINARY, frame.get_payload_as_memoryview())
            self.counters.frames_out += 1
            return
        if kind is WSMsgType.CLOSE:
            if not transport.is_close_frame_sent:
                transport.send_close(frame.get_close_code(), frame.get_close_message())
            transport.disconnect()
            return
        if kind is WSMsgType.CONTINUATION:
            self.fragments.append(frame.get_payload_as_bytes())
            if not frame.fin:
                return
            data, kind = b"".join(self.fragments), self.fragment_type
            self.fragments, self.fragment_type = [], None
        elif kind in (WSMsgType.BINARY, WSMsgType.TEXT):
            data = frame.get_payload_as_bytes()
            if not frame.fin:
                self.fragments, self.fragment_type = [data], kind
                return
        else:
            return  # ping and pong: picows answers pings itself
        if kind is WSMsgType.TEXT:
            self._event(transport, data)
        else:
            self._audio(transport, data)

    def _audio(self, transport: WSTransport, data: bytes) -> None:
        if self.partial:
            data, self.partial = self.partial + data, b""
        whole = len(data) - len(data) % FRAME_BYTES
        self.partial = data[whole:]
        view = memoryview(data)
        for start in range(0, whole, FRAME_BYTES):
            self.counters.frames_in += 1
            self.index += 1
            transport.send(WSMsgType.BINARY, view[start: start + FRAME_BYTES])
            self.counters.frames_out += 1

    def _event(self, transport: WSTransport, text: bytes) -> None:
        try:
            event = json.loads(text or b"{}")
        except ValueError:
            return
        if not isinstance(event, dict) or event.get("type") != "input.end":
            return
        if self.partial:  # padded with silence and counted, as duplexserve does
            self.counters.frames_in += 1
            self.index += 1
            transport.send(WSMsgType.BINARY, self.partial + bytes(FRAME_BYTES - len(self.partial)))
            self.counters.frames_out += 1
            self.partial = b""
        transport.send(WSMsgType.TEXT, json.dumps({
            "type": "session.closed", "reason": "completed",
            "frames_in": self.index, "frames_out": self.index, "frames_dropped": 0,
        }).encode())
        transport.send_close(WSCloseCode.OK)


def listener_factory(counters: EchoApp) -> Any:
    """picows' router: the HTTP endpoints get a plain response, anything else the echo."""

    def route(request: WSUpgradeRequest) -> Any:
        path = request.path.split(b"?", 1)[0]
        if path in _HTTP_PATHS:
            if path == b"/metrics":
                body = counters.metrics_text().encode()
                headers = {"Content-Type": "text/plain; version=0.0.4"}
            else:
                body, headers = b'{"status":"ok"}', {"Content-Type": "application/json"}
            return WSUpgradeResponseWithListener(WSUpgradeResponse.create_ok_response(body, headers), None)
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return None  # picows answers 404
        return EchoSession(counters)

    return route


async def serve(host: str, port: int, aiofastnet: bool | None = None) -> None:
    """Serve until SIGTERM or SIGINT. ``aiofastnet``: None is picows' default (on when installed)."""
    counters = EchoApp()  # its counters and /metrics text, never its ASGI side: both floors export alike
    server = await ws_create_server(
        listener_factory(counters), host, port, use_aiofastnet=aiofastnet, websocket_handshake_timeout=30
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m duplexserve.loadgen.echo_picows", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8998)
    parser.add_argument(
        "--transport",
        choices=("default", "aiofastnet", "loop"),
        default="default",
        help="picows' own transport (aiofastnet) or the event loop's (default: picows' choice)",
    )
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    import uvloop

    logging.basicConfig(level=args.log_level.upper())
    fast = {"default": None, "aiofastnet": True, "loop": False}[args.transport]
    uvloop.run(serve(args.host, args.port, fast))


if __name__ == "__main__":
    main()
