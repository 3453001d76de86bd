"""A duplex/1 test client that can lose its TCP connection and resume the session.

``drop()`` aborts the transport (no close handshake, like a cable pulled); ``resume()``
opens ``?resume=<token>&last_frame=<k>`` and sends again the input the server says it
did not get. Output frames are numbered by arrival: after a resume the replay starts
at ``last_frame + 1``, so a duplicate or a gap shows up as wrong content.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import websockets.asyncio.client


@dataclass
class ResumingClient:
    base_url: str  # ws://host:port/v1/duplex
    chunks: list[bytes]  # input messages, one or more whole frames each
    frames_per_chunk: int = 1
    query: str = ""
    frames: list[bytes] = field(default_factory=list)
    texts: list[int] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    resumed: list[dict[str, Any]] = field(default_factory=list)
    moved: list[dict[str, Any]] = field(default_factory=list)  # session.moved events (then 1012)
    created: dict[str, Any] | None = None
    close_code: int | None = None
    sent_frames: int = 0  # input frames sent so far (on any connection)
    _ws: Any = None
    _reader: asyncio.Task[None] | None = None
    _new_frame: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def token(self) -> str:
        last = self.resumed[-1] if self.resumed else self.created
        assert last is not None
        return last["resume"]["token"]

    @property
    def closed(self) -> dict[str, Any] | None:
        found = [e for e in self.events if e.get("type") == "session.closed"]
        return found[-1] if found else None

    async def open(self) -> None:
        url = self.base_url + (f"?{self.query}" if self.query else "")
        self._ws = await websockets.asyncio.client.connect(url, compression=None, max_size=None)
        self.created = json.loads(await self._ws.recv())
        self._reader = asyncio.create_task(self._read(self._ws))

    async def _read(self, ws: Any) -> None:
        with contextlib.suppress(websockets.ConnectionClosed, OSError):
            async for msg in ws:
                if isinstance(msg, bytes):
                    self.frames.append(msg)
                    self._new_frame.set()
                else:
                    event = json.loads(msg)
                    self.events.append(event)
                    if event["type"] == "text.delta":
                        self.texts.append(event["frame"])
                    elif event["type"] == "session.moved":
                        self.moved.append(event)

    async def send(self, upto_frames: int, gap: float = 0.0) -> None:
        """Send input messages until ``upto_frames`` input frames went out."""
        while self.sent_frames < upto_frames:
            await self._ws.send(self.chunks[self.sent_frames // self.frames_per_chunk])
            self.sent_frames += self.frames_per_chunk
            if gap:
                await asyncio.sleep(gap)

    async def wait_frames(self, count: int, timeout: float = 30.0) -> None:
        async def until() -> None:
            while len(self.frames) < count:
                self._new_frame.clear()
                await self._new_frame.wait()

        await asyncio.wait_for(until(), timeout)

    def drop(self) -> None:
        """Cut the TCP connection: no close frame, no FIN handshake wait."""
        self._ws.transport.abort()
        if self._reader is not None:
            self._reader.cancel()

    async def follow(self, base_url: str | None = None) -> dict[str, Any]:
        """After ``session.moved`` and its close 1012: resume with the token it gave, at
        ``base_url`` (the fleet's address; by default the same one), from the last frame received."""
        if base_url is not None:
            self.base_url = base_url
        return await self.resume(token=self.moved[-1]["resume"]["token"])

    async def resume(self, last_frame: int | None = None, token: str | None = None) -> dict[str, Any]:
        """Resume; returns the server's first event (``session.resumed`` or an error)."""
        k = len(self.frames) - 1 if last_frame is None else last_frame
        del self.frames[k + 1 :]  # anything after k comes again
        self.texts = [i for i in self.texts if i <= k]
        url = f"{self.base_url}?resume={token or self.token}&last_frame={k}"
        self._ws = await websockets.asyncio.client.connect(url, compression=None, max_size=None)
        first = json.loads(await self._ws.recv())
        if first["type"] == "session.resumed":
            self.resumed.append(first)
            self.sent_frames = first["frames_in"]  # send again what did not arrive
        self._reader = asyncio.create_task(self._read(self._ws))
        return first

    async def finish(self, timeout: float = 60.0) -> None:
        """input.end, then read until the server closes."""
        with contextlib.suppress(websockets.ConnectionClosed):
            await self._ws.send(json.dumps({"type": "input.end"}))
        assert self._reader is not None
        await asyncio.wait_for(self._reader, timeout)
        self.close_code = self._ws.close_code

    async def wait_closed(self, timeout: float = 30.0) -> None:
        assert self._reader is not None
        await asyncio.wait_for(self._reader, timeout)
        self.close_code = self._ws.close_code
