"""The ASGI application: FastAPI for HTTP routes, raw ASGI for the WebSocket protocols.

WebSocket scopes go straight to the protocol adapter, without a framework layer per
message; everything else (health, readiness, metrics) is an ordinary FastAPI route.
With ``--api-keys`` (or ``--api-keys-file``), ``/v1/models`` and the API docs (and ``/metrics``
with ``--metrics-auth``) need a key like the API itself; ``/``, ``/static``, ``/health`` and
``/ready`` stay open.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from duplexserve import __version__, errors
from duplexserve.codecs.opus_budget import OpusLimits
from duplexserve.codecs.procpool import CodecProcesses
from duplexserve.config import ServerConfig, trusted_proxies
from duplexserve.engine_bridge.engine import Engine
from duplexserve.engine_bridge.factory import build_engine
from duplexserve.server import auth, gc_pauses, personas
from duplexserve.server.calls import WebRTCCalls, WebRTCCollector
from duplexserve.server.core.adapter import ProtocolAdapter
from duplexserve.server.core.client_address import ForwardedFor, client_of
from duplexserve.server.core.orchestrator import Orchestrator
from duplexserve.server.core.session import Limits
from duplexserve.server.http_errors import http_error
from duplexserve.server.key_file import KeyFile
from duplexserve.server.metrics import CodecProcessesCollector, Metrics
from duplexserve.server.overload import OverloadCollector, OverloadManager, Thresholds
from duplexserve.server.peer_forward import PeerForwardCollector, PeerForwarder
from duplexserve.server.peer_move import MOVE_PATH, PeerMoveCollector, PeerMover
from duplexserve.server.protocols.moshi_chat import MoshiConnection
from duplexserve.server.protocols.native import NativeConnection
from duplexserve.server.protocols.realtime.adapter import RealtimeConnection
from duplexserve.server.protocols.twilio.adapter import TwilioConnection
from duplexserve.server.protocols.twilio.path import rewrite_model_path
from duplexserve.server.protocols.twilio.wire import TwilioCollector
from duplexserve.server.served_models import served_names
from duplexserve.server.transports.websocket.budgets import ParseLimits, ParseMeter
from duplexserve.server.transports.websocket.connection import Receive, Scope, Send, WebSocketTransport

#: The protocol each WebSocket path speaks; the transport is the WebSocket (the WebRTC
#: calls, ``POST /v1/realtime/calls``, are the Realtime protocol on the WebRTC transport).
PROTOCOLS: dict[str, type[ProtocolAdapter]] = {
    "/v1/duplex": NativeConnection,
    "/v1/realtime": RealtimeConnection,
    "/api/chat": MoshiConnection,
    "/v1/twilio": TwilioConnection,
}
# The talk page at / (docs/deploy.md): plain files, no build step.
STATIC_DIR = Path(__file__).with_name("static")
#: The talk page's own files only: no inline script, nothing from another origin, and no
#: other site may frame it (a header: a <meta> policy cannot say frame-ancestors).
TALK_PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "media-src 'self'; base-uri 'self'; form-action 'none'; frame-ancestors 'none'"
)
#: Routes that need a key when --api-keys names any, checked before FastAPI sees them:
#: FastAPI's own (the schema and its pages) take no dependency. /v1/models too: OpenAI's
#: clients send their key on it, and the names it lists are the deployment's own.
DOCS_PATHS = frozenset({"/docs", "/redoc", "/openapi.json"})
KEYED_PATHS = DOCS_PATHS | {"/v1/models"}


class DuplexApp:
    #: Set by ``serve``: once started, move every object alive so far (modules, the
    #: engine, the app) into the collector's permanent generation (``gc.freeze``).
    #: Sessions allocate objects that outlive a young collection (a frame waiting for a
    #: codec, buffered output), which triggers full collections; without the freeze each
    #: one walks the whole heap of FastAPI, numpy and the engine: 14% of the loop's time
    #: under 100 paced Opus sessions (py-spy). Off for apps built in tests, which come and go.
    freeze_gc = False

    def __init__(self, config: ServerConfig, engine: Engine | None = None) -> None:
        config.validate()
        self.config = config
        limits = Limits(
            config.inflight_frames, config.max_pending_frames, config.max_output_frames,
            max(1, round(config.drain_max_s * 12.5)),  # frames of 80 ms
            config.max_output_event_bytes,
        )  # fmt: skip
        self.orchestrator = Orchestrator(
            engine or build_engine(config),
            limits,
            queue_size=config.queue_size,
            idle_timeout_s=config.idle_timeout_s,
            max_session_s=config.max_session_s,
            max_sessions_per_client=config.max_sessions_per_client,
            max_prompt_bytes=config.max_prompt_bytes,
            engine_stall_s=config.engine_stall_s,
            coalesce_ms=config.engine_coalesce_ms,
            tick_ms=config.engine_tick_ms,
            gather=config.engine_gather == "on",
            resume_grace_s=config.resume_grace_s,
            max_detached=config.max_detached,
            max_detached_per_client=config.max_detached_per_client,
            client_ipv6_prefix=config.client_ipv6_prefix,
            late_frame_ms=config.late_frame_ms,
            replica_id=config.replica_id,
            engine_factory=None if engine else lambda: build_engine(config),
        )
        self.metrics = Metrics(self.orchestrator)
        self.orchestrator.on_step = self.metrics.observe_step
        self.orchestrator.on_deliver = self.metrics.observe_delivery
        self.codec_pool = ThreadPoolExecutor(max_workers=config.codec_threads, thread_name_prefix="codec")
        self.codec_procs = CodecProcesses(
            config.codec_processes, config.opus_complexity, config.codec_batch_ms,
            OpusLimits(config.opus_ahead_s, config.opus_ms_per_byte),
        )
        self.metrics.registry.register(CodecProcessesCollector(self.codec_procs.cpu_seconds))
        self.metrics.registry.register(TwilioCollector())
        self.webrtc = WebRTCCalls(config, self.orchestrator, self.codec_pool, self.codec_procs)
        self.metrics.registry.register(WebRTCCollector(self.webrtc))
        #: Sheds what is not live audio when the loop runs late (server/overload.py).
        #: The loop's time handling JSON messages, per connection, per address and in all.
        self.parse = ParseMeter(
            ParseLimits(config.ws_max_parse_ms_per_s, config.ws_max_address_parse_ms_per_s),
            list(auth.parse_list(config.forwarded_allow_ips)),
            config.client_ipv6_prefix,
        )
        thresholds = Thresholds(
            config.overload_lag_ms / 1000, config.overload_gil_wait_ms / 1000, config.overload_parse_share
        )
        self.overload = OverloadManager(
            thresholds, lambda: self.orchestrator.bridge.take_gil_wait(), self.parse.take_spent,
            config.client_ipv6_prefix,
        )
        self.parse.fair = self.overload  # text messages charged to their client's fair share
        self.metrics.registry.register(OverloadCollector(self.overload))
        #: Resumes for sessions on another replica (server/peer_forward.py).
        self.peers = PeerForwarder(config.replica_id, config.peer_url_template, config.peer_secret)
        self.metrics.registry.register(PeerForwardCollector(self.peers))
        #: Live migration: sessions moved to peers on drain, and taken in from them (server/peer_move.py).
        self.mover = PeerMover(config, self.orchestrator, self.codec_procs)
        self.metrics.registry.register(PeerMoveCollector(self.mover))
        self.http = self._http_app()
        #: --api-keys-file: loaded now (into config.api_keys), re-read on change while serving.
        self.key_file = KeyFile(config) if config.api_keys_file else None
        self.keyed_paths = KEYED_PATHS | ({"/metrics"} if config.metrics_auth else set())
        proxies = trusted_proxies(config.forwarded_allow_ips)
        #: The client and scheme that trusted proxies name, in place of uvicorn's proxy headers.
        self.forwarded = ForwardedFor(proxies) if proxies else None

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        await self.orchestrator.start()
        if self.freeze_gc:  # after the engine and everything else of the startup exist
            gc_pauses.freeze()
        self.metrics.gc_pauses.start()
        self.overload.start()
        if self.key_file is not None:
            self.key_file.start()
        try:
            yield
        finally:
            if self.key_file is not None:
                await self.key_file.stop()
            self.overload.stop()
            self.metrics.gc_pauses.stop()
            await self.orchestrator.stop()
            await self.webrtc.close()
            self.codec_pool.shutdown(wait=False, cancel_futures=True)
            self.codec_procs.close()

    def _http_app(self) -> FastAPI:
        app = FastAPI(
            title="duplexserve", version=__version__, lifespan=self._lifespan, docs_url=None, redoc_url=None
        )
        orch = self.orchestrator
        origins = auth.parse_list(self.config.allowed_origins)
        if origins:  # pages of other origins that may call the HTTP API (preflight and headers)
            app.add_middleware(
                CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
                allow_headers=["authorization", "content-type"], expose_headers=["location"],
            )  # fmt: skip

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

        @app.get("/docs", include_in_schema=False)
        async def docs(request: Request) -> HTMLResponse:
            return get_swagger_ui_html(openapi_url=_schema_url(request), title="duplexserve")

        @app.get("/redoc", include_in_schema=False)
        async def redoc(request: Request) -> HTMLResponse:
            return get_redoc_html(openapi_url=_schema_url(request), title="duplexserve")

        @app.get("/", include_in_schema=False)
        async def index() -> FileResponse:
            return FileResponse(STATIC_DIR / "index.html", headers={"Content-Security-Policy": TALK_PAGE_CSP})

        app.get("/v1/models")(models_route(self.config))
        app.get("/v1/voices")(personas.voices_route(self.config, orch))  # voice prompts (PersonaPlex)
        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
        self.webrtc.add_routes(app)  # POST /v1/realtime/calls, .../hangup, /v1/realtime/client_secrets
        app.post(MOVE_PATH, include_in_schema=False)(self.mover.endpoint)  # a peer's session, signed

        return app

    async def _to_peer(self, scope: Scope, receive: Receive, send: Send, adapter: ProtocolAdapter) -> bool:
        """A resume for a session another replica holds is relayed to it, and a forwarded one
        that fails the peer check is refused (server/peer_forward.py); True when done here."""
        peers = self.peers
        refused = peers.check(scope)
        name = None if refused is not None else peers.owner(scope)
        if refused is None and name is None:
            return False
        if (await receive())["type"] != "websocket.connect":
            return True
        if name is not None and self.orchestrator.draining:  # leaving: a proxy tries another replica
            await adapter.refuse(errors.TRY_AGAIN, "server_unavailable", "draining: it relays no resume")
            return True
        if name is not None:
            config = self.config
            if not auth.origin_allowed(scope, auth.parse_list(config.allowed_origins)) or not auth.key_ok(
                scope, adapter.query, auth.parse_list(config.api_keys)
            ):
                refused = ("unauthorized", "a valid API key is required")
            else:
                reason = await peers.forward(name, scope, receive, send)
                if reason is None:
                    return True
                self.orchestrator.resume.refuse()
                refused = ("resume_failed", reason)
        assert refused is not None
        await adapter.refuse(errors.POLICY, *refused)
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.forwarded is not None and scope["type"] != "lifespan":
            self.forwarded.rewrite(scope)
        if scope["type"] == "websocket":
            rewrite_model_path(scope)  # /v1/twilio/MODEL: Twilio drops the Stream URL's query
            protocol = PROTOCOLS.get(scope["path"])
            if protocol is None:
                await receive()
                await send({"type": "websocket.close", "code": 1008})
                return
            transport = WebSocketTransport(scope, receive, send, self.config)
            adapter = protocol(transport, self.orchestrator, self.config, self.codec_pool, self.codec_procs)
            client = client_of(scope)
            if not self.overload.admit_session(client and self.overload.key(client.host)):  # before any work
                if (await receive())["type"] == "websocket.connect":
                    await adapter.refuse(errors.TRY_AGAIN, "server_unavailable", "overloaded: retry later")
                return
            if not await self._to_peer(scope, receive, send, adapter):
                await transport.run(adapter)
            return
        if scope["type"] == "http" and scope["path"] in self.keyed_paths and self.config.api_keys:
            query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
            if not auth.key_ok(scope, query, auth.parse_list(self.config.api_keys)):
                await http_error(401, "invalid_api_key", "a valid API key is required")(scope, receive, send)
                return
        await self.http(scope, receive, send)


def models_route(config: ServerConfig) -> Callable[[], Awaitable[dict[str, Any]]]:
    """``GET /v1/models`` as OpenAI's SDKs read it: the names ``?model=`` may give with
    ``--served-model-name`` (others are refused ``model_not_found``), else the server's own."""
    created = int(time.time())
    listed = [{"id": name, "object": "model", "created": created, "owned_by": config.model_owner}
              for name in served_names(config)]

    async def models() -> dict[str, Any]:
        return {"object": "list", "data": listed}

    return models


def _schema_url(request: Request) -> str:
    """The schema for a docs page, relative (a proxy may serve us under a prefix), with the
    page's ``?token=`` passed on: the page fetches it without the key's header."""
    token = request.query_params.get("token")
    return "openapi.json" + (f"?token={quote(token, safe='')}" if token else "")


def create_app(config: ServerConfig | None = None, engine: Engine | None = None) -> DuplexApp:
    return DuplexApp(config or ServerConfig(), engine)
