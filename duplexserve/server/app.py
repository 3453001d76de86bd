"""The ASGI application: FastAPI for HTTP routes, raw ASGI for the WebSocket protocols.

WebSocket scopes go straight to the protocol adapter, without a framework layer per
message; everything else (health, readiness, metrics) is an ordinary FastAPI route.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from duplexserve import __version__
from duplexserve.config import ServerConfig
from duplexserve.engine_bridge.engine import Engine
from duplexserve.engine_bridge.factory import build_engine
from duplexserve.server.connection import Connection, Receive, Scope, Send
from duplexserve.server.metrics import Metrics
from duplexserve.server.native import NativeConnection
from duplexserve.server.orchestrator import Orchestrator
from duplexserve.server.session import Limits

PROTOCOLS: dict[str, type[Connection]] = {"/v1/duplex": NativeConnection}


class DuplexApp:
    def __init__(self, config: ServerConfig, engine: Engine | None = None) -> None:
        config.validate()
        self.config = config
        limits = Limits(config.inflight_frames, config.max_pending_frames, config.max_output_frames)
        self.orchestrator = Orchestrator(
            engine or build_engine(config),
            limits,
            queue_size=config.queue_size,
            idle_timeout_s=config.idle_timeout_s,
            max_session_s=config.max_session_s,
        )
        self.metrics = Metrics(self.orchestrator)
        self.orchestrator.bridge.on_step = self.metrics.observe_step
        self.codec_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="codec")
        self.http = self._http_app()

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        await self.orchestrator.start()
        try:
            yield
        finally:
            await self.orchestrator.stop()
            self.codec_pool.shutdown(wait=False, cancel_futures=True)

    def _http_app(self) -> FastAPI:
        app = FastAPI(title="duplexserve", version=__version__, lifespan=self._lifespan)
        orch = self.orchestrator

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok"}

        @app.get("/ready")
        async def ready(response: Response) -> dict[str, Any]:
            if not orch.ready:
                response.status_code = 503
            return {
                "ready": orch.ready,
                "draining": orch.draining,
                "sessions": orch.active,
                "max_sessions": orch.engine.num_slots,
                "engine": orch.engine.name,
            }

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        return app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            protocol = PROTOCOLS.get(scope["path"])
            if protocol is None:
                await receive()
                await send({"type": "websocket.close", "code": 1008})
                return
            await protocol(
                scope, receive, send, self.orchestrator, self.config, self.codec_pool
            ).run()
            return
        await self.http(scope, receive, send)


def create_app(config: ServerConfig | None = None, engine: Engine | None = None) -> DuplexApp:
    return DuplexApp(config or ServerConfig(), engine)
