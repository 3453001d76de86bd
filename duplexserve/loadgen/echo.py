"""The floor: a bare echo server on the same WebSocket stack as duplexserve.

A raw ASGI app under uvicorn with exactly the settings of
:func:`duplexserve.server.run.uvicorn_config`. With ``--ws fast`` it runs on duplexserve's
own fast path (``server/transports/websocket/protocol.py``: a callback per message, synchronous sends, the
frame reader of ``server/transports/websocket/frames.py``) instead of ASGI messages: the floor of that path's
framing and transport. It speaks just enough of ``duplex/1`` for the load generator
(``session.created``, one binary message per 80 ms frame, ``input.end`` answered by
``session.closed``) and nothing else: no orchestration, no engine, no thread. What
duplexserve costs beyond it is what orchestration costs.

It exports the counters duplexserve exports, under the same names and read the same
way (``getrusage`` of the process), so both are measured alike. With ``--fault`` it
misbehaves on purpose (drops, reorders or alters one frame of each session) so the
load generator's guards can be shown to catch it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import secrets
from typing import Any

from duplexserve.codecs.formats import FRAME_SAMPLES
from duplexserve.config import ServerConfig
from duplexserve.server.transports.websocket.protocol import EXTENSION, FastWebSocketProtocol

FRAME_BYTES = 4 * FRAME_SAMPLES  # pcm_f32le at 24 kHz, the only format the floor speaks
FAULTS = ("drop", "reorder", "alter")


class EchoApp:
    def __init__(self, fault: str | None = None, fault_frame: int = 3) -> None:
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"fault is one of {', '.join(FAULTS)}")
        self.fault = fault
        self.fault_frame = fault_frame
        self.frames_in = 0
        self.frames_out = 0
        self.sessions = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "websocket":
            await self._session(scope, receive, send)
        elif kind == "http":
            await self._http(scope, send)
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def _session(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        self.sessions += 1
        await send({"type": "websocket.accept"})
        fmt = {"format": "pcm_f32le", "sample_rate": 24000, "frame_samples": FRAME_SAMPLES}
        await send({"type": "websocket.send", "text": json.dumps({
            "type": "session.created", "protocol": "duplex/1", "session_id": secrets.token_hex(8),
            "model": "echo", "engine": "bare-echo", "frame_ms": 80, "input": fmt, "output": fmt,
        })})
        stream = _Stream(self)
        sock = scope.get("extensions", {}).get(EXTENSION, {}).get("socket")
        if sock is not None:
            await self._fast(stream, sock)
            return
        while True:
            message = await receive()
            if message["type"] != "websocket.receive":
                return
            data = message.get("bytes")
            if data is not None and stream.straight(data):  # the common case: send it straight back
                await self._out(send, data)
                continue
            frames, closed = stream.take(message.get("text") or "{}" if data is None else data)
            for frame in frames:
                await self._out(send, frame)
            if closed is not None:
                await send({"type": "websocket.send", "text": closed})
                await send({"type": "websocket.close", "code": 1000})
                return

    async def _fast(self, stream: _Stream, sock: FastWebSocketProtocol) -> None:
        """The same session on duplexserve's fast path: a callback per message, sends at once."""
        gone = asyncio.get_running_loop().create_future()

        def on_message(message: bytes | str) -> None:
            if message.__class__ is bytes and stream.straight(message):  # type: ignore[arg-type]
                sock.send_bytes(message)  # type: ignore[arg-type]
                self.frames_out += 1
                return
            frames, closed = stream.take(message)
            for frame in frames:
                sock.send_bytes(frame)
                self.frames_out += 1
            if closed is not None:
                sock.send_text(closed)
                sock.close(1000)

        def on_lost() -> None:
            if not gone.done():
                gone.set_result(None)

        sock.start(on_message, on_lost, _nothing)
        try:
            await gone
        finally:
            sock.release()

    def _misbehave(self, index: int, frame: bytes, held: bytes | None) -> tuple[list[bytes], bytes | None]:
        """(frames to send now, frame held back) under the configured fault."""
        if index == self.fault_frame:
            if self.fault == "drop":
                return [], held
            if self.fault == "reorder":
                return [], frame  # sent after the next one
            altered = bytearray(frame)
            altered[0] ^= 0x40  # one bit of the first sample: the same size, other content
            return [bytes(altered)], held
        if held is not None:
            return [frame, held], None
        return [frame], held

    async def _out(self, send: Any, frame: bytes) -> None:
        await send({"type": "websocket.send", "bytes": frame})
        self.frames_out += 1

    async def _http(self, scope: dict[str, Any], send: Any) -> None:
        path = scope["path"]
        if path == "/metrics":
            body = self.metrics_text().encode()
            status = 200
        elif path in ("/health", "/ready"):
            body, status = b'{"status":"ok"}', 200
        else:
            body, status = b"not found", 404
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
        await send({"type": "http.response.body", "body": body})

    def metrics_text(self) -> str:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        lines = []
        for name, value in (
            ("cpu_seconds_total", usage.ru_utime + usage.ru_stime),
            ("voluntary_context_switches_total", usage.ru_nvcsw),
            ("involuntary_context_switches_total", usage.ru_nivcsw),
            ("executor_submissions_total", 0),
            ("frames_in_total", self.frames_in),
            ("frames_out_total", self.frames_out),
            ("sessions_accepted_total", self.sessions),
        ):
            lines.append(f"duplexserve_{name} {value}")
        return "\n".join(lines) + "\n"


class _Stream:
    """One session's input cut into frames, faults applied: what both paths share."""

    def __init__(self, app: EchoApp) -> None:
        self.app = app
        self.partial = b""
        self.index = 0
        self.held: bytes | None = None

    def straight(self, data: bytes) -> bool:
        """A whole frame with nothing held back and no fault: counted, to be sent as it is."""
        if len(data) != FRAME_BYTES or self.partial or self.app.fault is not None:
            return False
        self.app.frames_in += 1
        self.index += 1
        return True

    def take(self, message: bytes | str) -> tuple[list[bytes], str | None]:
        """Any other message: the frames to send, then the ``session.closed`` event to send
        after them if the input ended (else None)."""
        if isinstance(message, str):
            return self._end(message)
        return self._cut(message), None

    def _cut(self, data: bytes) -> list[bytes]:
        """Whole frames of ``partial + data``; the rest is kept for the next message."""
        if self.partial:
            data, self.partial = self.partial + data, b""
        whole = len(data) - len(data) % FRAME_BYTES
        self.partial = data[whole:]
        app, out = self.app, []
        for start in range(0, whole, FRAME_BYTES):
            frame = data[start: start + FRAME_BYTES]
            app.frames_in += 1
            self.index += 1
            if app.fault is None:
                out.append(frame)
                continue
            sent, self.held = app._misbehave(self.index - 1, frame, self.held)
            out += sent
        return out

    def _end(self, text: str) -> tuple[list[bytes], str | None]:
        if json.loads(text).get("type") != "input.end":
            return [], None
        out = []
        if self.partial:  # padded with silence and counted, as duplexserve does
            self.app.frames_in += 1
            self.index += 1
            out.append(self.partial + bytes(FRAME_BYTES - len(self.partial)))
            self.partial = b""
        return out, json.dumps({
            "type": "session.closed", "reason": "completed",
            "frames_in": self.index, "frames_out": self.index, "frames_dropped": 0,
        })


def _nothing() -> None:
    pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m duplexserve.loadgen.echo", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8999)
    parser.add_argument(
        "--ws", default="websockets-sansio", choices=("websockets-sansio", "websockets", "fast"),
        help="fast: duplexserve's own fast path (server/transports/websocket/protocol.py)",
    )
    parser.add_argument("--fault", choices=FAULTS, help="misbehave on one frame of every session")
    parser.add_argument("--fault-frame", type=int, default=3, help="which output frame (0-based)")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    import uvicorn

    from duplexserve.server.run import uvicorn_config

    logging.basicConfig(level=args.log_level.upper())
    config = ServerConfig(host=args.host, port=args.port, ws=args.ws, log_level=args.log_level)
    uvicorn.Server(uvicorn_config(config, EchoApp(args.fault, args.fault_frame), budgets=False)).run()


if __name__ == "__main__":
    main()
