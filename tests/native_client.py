"""A plain duplex/1 client for tests: send messages, collect everything that comes back."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import websockets.asyncio.client


@dataclass
class Result:
    created: dict[str, Any]
    frames: list[bytes] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    close_code: int | None = None

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == kind]

    @property
    def closed(self) -> dict[str, Any] | None:
        found = self.of_type("session.closed")
        return found[-1] if found else None


def signal(frames: int, seed: int = 0, samples: int = 1920) -> np.ndarray:
    """Deterministic noise in [-0.5, 0.5): every frame differs, so order is checkable."""
    return (np.random.default_rng(seed).random(frames * samples, dtype=np.float32) - 0.5).astype(np.float32)


async def converse(
    url: str,
    messages: list[bytes | str | dict[str, Any]],
    end: bool = True,
    timeout: float = 60.0,
    gap: float = 0.0,
) -> Result:
    """Send every message (dicts as JSON), then input.end, and read until the server closes."""
    async with websockets.asyncio.client.connect(url, compression=None, max_size=None) as ws:
        result = Result(json.loads(await ws.recv()))

        async def reader() -> None:
            with contextlib.suppress(websockets.ConnectionClosed):
                async for msg in ws:
                    if isinstance(msg, bytes):
                        result.frames.append(msg)
                    else:
                        result.events.append(json.loads(msg))

        task = asyncio.create_task(reader())
        try:
            for m in messages:
                await ws.send(json.dumps(m) if isinstance(m, dict) else m)
                if gap:
                    await asyncio.sleep(gap)
            if end:
                await ws.send(json.dumps({"type": "input.end"}))
        except websockets.ConnectionClosed:
            pass
        await asyncio.wait_for(task, timeout)
        result.close_code = ws.close_code
        return result
