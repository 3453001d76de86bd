"""The floor: a bare echo server on the same WebSocket stack as duplexserve.

A raw ASGI app under uvicorn with exactly the settings of
:func:`duplexserve.server.run.uvicorn_config`. It speaks just enough of ``duplex/1``
for the load generator (``session.created``, one binary message per 80 ms frame,
``input.end`` answered by ``session.closed``) and nothing else: no orchestration, no
engine, no thread. What duplexserve costs beyond it is what orchestration costs.

It exports the counters duplexserve exports, under the same names and read the same
way (``getrusage`` of the process), so both are measured alike. With ``--fault`` it
misbehaves on purpose (drops, reorders or alters one frame of each session) so the
load generator's guards can be shown to catch it.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import secrets
from typing import Any

from duplexserve.codecs.formats import FRAME_SAMPLES
from duplexserve.config import ServerConfig

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
            await self._session(receive, send)
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

    async def _session(self, receive: Any, send: Any) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        self.sessions += 1
        await send({"type": "websocket.accept"})
        fmt = {"format": "pcm_f32le", "sample_rate": 24000, "frame_samples": FRAME_SAMPLES}
        await send({"type": "websocket.send", "text": json.dumps({
            "type": "session.created", "protocol": "duplex/1", "session_id": secrets.token_hex(8),
            "model": "echo", "engine": "bare-echo", "frame_ms": 80, "input": fmt, "output": fmt,
        })})
        partial = b""
        index = 0
        held: bytes | None = None
        while True:
            message = await receive()
            if message["type"] != "websocket.receive":
                return
            data = message.get("bytes")
            if data is None:
                event = json.loads(message.get("text") or "{}")
                if event.get("type") == "input.end":
                    if partial:  # padded with silence and counted, as duplexserve does
                        self.frames_in += 1
                        index += 1
                        await self._out(send, partial + bytes(FRAME_BYTES - len(partial)))
                    await send({"type": "websocket.send", "text": json.dumps({
                        "type": "session.closed", "reason": "completed",
                        "frames_in": index, "frames_out": index, "frames_dropped": 0,
                    })})
                    await send({"type": "websocket.close", "code": 1000})
                    return
                continue
            if partial:
                data, partial = partial + data, b""
            size = len(data)
            if size == FRAME_BYTES and self.fault is None:  # the common case: send it straight back
                self.frames_in += 1
                index += 1
                await self._out(send, data)
                continue
            whole = size - size % FRAME_BYTES
            partial = data[whole:]
            for start in range(0, whole, FRAME_BYTES):
                frame = data[start: start + FRAME_BYTES]
                self.frames_in += 1
                index += 1
                if self.fault is None:
                    await self._out(send, frame)
                    continue
                out, held = self._misbehave(index - 1, frame, held)
                for item in out:
                    await self._out(send, item)

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m duplexserve.loadgen.echo", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8999)
    parser.add_argument("--ws", default="websockets-sansio", choices=("websockets-sansio", "websockets"))
    parser.add_argument("--fault", choices=FAULTS, help="misbehave on one frame of every session")
    parser.add_argument("--fault-frame", type=int, default=3, help="which output frame (0-based)")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    import uvicorn

    from duplexserve.server.run import uvicorn_config

    logging.basicConfig(level=args.log_level.upper())
    config = ServerConfig(host=args.host, port=args.port, ws=args.ws, log_level=args.log_level)
    uvicorn.Server(uvicorn_config(config, EchoApp(args.fault, args.fault_frame))).run()


if __name__ == "__main__":
    main()
