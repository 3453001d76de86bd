"""OpenAI Realtime over WebRTC: ``POST /v1/realtime/calls`` and the calls it answers.

As OpenAI's: the client sends its SDP offer (``application/sdp``, or multipart with
``sdp`` and ``session``, the session config of ``session.update``) and gets ``201`` with
the answer and a ``Location`` naming the call. ``POST /v1/realtime/calls/{id}/hangup``
ends a call.

A call is the Realtime protocol (server/protocols/realtime/) on the WebRTC transport
(server/transports/webrtc/call.py): the events of ``/v1/realtime`` over the data channel,
the audio on the media track. So the session core, the orchestrator, the limits, drain,
resume rules (none: a Realtime session ends with its connection) and the turnaround
figures are the same as every protocol's. This module is app wiring: the one place that
puts that protocol on that transport.
"""

from __future__ import annotations

import asyncio
import collections
import email.parser
import email.policy
import gc
import logging
import secrets
from collections.abc import Iterator
from concurrent.futures import Executor
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from duplexserve import errors
from duplexserve.codecs.procpool import CodecProcesses
from duplexserve.config import ServerConfig
from duplexserve.server import auth
from duplexserve.server.client_secrets import ClientSecrets
from duplexserve.server.core.budgets import over_budget
from duplexserve.server.core.client_address import client_of
from duplexserve.server.core.orchestrator import Orchestrator
from duplexserve.server.http_errors import http_error
from duplexserve.server.protocols.realtime.adapter import RealtimeConnection
from duplexserve.server.request_body import BodyTooLarge, parse_json, read_body
from duplexserve.server.served_models import not_served
from duplexserve.server.transports.webrtc import peer as webrtc_peer
from duplexserve.server.transports.webrtc.call import WebRTCCall, refusal_status
from duplexserve.server.transports.webrtc.clock import PlayClock
from duplexserve.server.transports.webrtc.jitter import JitterCounts

log = logging.getLogger(__name__)

#: Distinct remote candidates an offer may name at most: the server sends STUN checks to each
#: (an offer naming 300 addresses made it send 1,800 packets to them). A browser names two or
#: three per network interface; past this the offer is refused (400 ``too_many_candidates``).
MAX_CANDIDATES = 32
#: Distinct remote candidates kept at most (webrtc_peer.peer_candidates): those on the address
#: the offer came from, or any address behind TURN. A browser names a few per address.
MAX_CHECKED = 8


def _too_large(exc: BodyTooLarge) -> JSONResponse:
    """413, and the connection closed after it: the rest of the body is never read."""
    answer = http_error(413, "body_too_large", str(exc))
    answer.headers["connection"] = "close"
    return answer


def _check_sdp(sdp: str) -> None:
    """What aiortc's lenient parser lets through: every line ``<letter>=...`` (RFC 8866),
    and the session's ``v=``, ``o=`` and ``s=`` lines."""
    lines = [line for line in sdp.splitlines() if line]
    bad = next((line for line in lines if len(line) < 2 or line[1] != "=" or not line[0].isalpha()), None)
    if bad is not None:
        raise ValueError(f"not an SDP line: {bad[:80]!r}")
    if not lines or lines[0] != "v=0" or not {"o", "s"} <= {line[0] for line in lines}:
        raise ValueError("an SDP description starts with v=0 and has o= and s= lines")


def _multipart(content_type: str, body: bytes) -> dict[str, str]:
    """The text parts of a multipart/form-data body, by name (stdlib, no extra package)."""
    raw = b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(raw)
    if not message.is_multipart():
        raise ValueError("not a multipart body")
    parts = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True) or b""
            parts[name] = payload.decode("utf-8")
    return parts


class WebRTCCalls:
    """The calls of this server and the HTTP routes that make and end them."""

    def __init__(
        self,
        config: ServerConfig,
        orchestrator: Orchestrator,
        codec_pool: Executor | None,
        codec_procs: CodecProcesses | None,
    ) -> None:
        self.config, self.orch = config, orchestrator
        self.codec_pool, self.codec_procs = codec_pool, codec_procs
        self.secrets = ClientSecrets()
        self.problem = webrtc_peer.internals_problem()
        if self.problem is not None:
            log.info("WebRTC is off: %s", self.problem)
        self.ice_servers = webrtc_peer.parse_ice_servers(config.ice_servers)
        #: Behind TURN the relay needs every candidate's address: no address filter then.
        self.relay = webrtc_peer.relays(self.ice_servers)
        webrtc_peer.restrict_host_addresses(auth.parse_list(config.ice_host_addresses))
        self.calls: dict[str, WebRTCCall] = {}
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.ended_counts = JitterCounts()
        self.ended_skipped = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._clock: PlayClock | None = None  # made on the loop, with the first call

    def add_routes(self, app: FastAPI) -> None:
        app.post("/v1/realtime/calls")(self.create)
        app.post("/v1/realtime/calls/{call_id}/hangup")(self.hangup)
        app.post("/v1/realtime/client_secrets")(self.client_secret)
        app.get("/v1/realtime/ice_servers")(self.browser_ice_servers)

    # ------------------------------------------------------------------ checks
    def _server_key_ok(self, request: Request) -> bool:
        return auth.key_ok(request.scope, dict(request.query_params), auth.parse_list(self.config.api_keys))

    def _refused(self, request: Request) -> JSONResponse | None:
        if not auth.origin_allowed(request.scope, auth.parse_list(self.config.allowed_origins)):
            self.outcomes["forbidden"] += 1
            return http_error(403, "origin_not_allowed", "this Origin may not connect")
        return None

    # ------------------------------------------------------------------ routes
    async def create(self, request: Request) -> Response:
        """``POST /v1/realtime/calls``: the offer in, the answer out (201)."""
        if self.problem is not None:
            self.outcomes["unavailable"] += 1
            return http_error(501, "webrtc_unavailable", self.problem)
        refused = self._refused(request)
        if refused is not None:
            return refused
        secret = None
        if not self._server_key_ok(request):
            secret = self.secrets.take(auth.presented_keys(request.scope, dict(request.query_params)))
            if secret is None:
                self.outcomes["unauthorized"] += 1
                return http_error(401, "invalid_api_key", "a valid API key or client secret is required")
        answered = False
        try:  # a secret is spent by an answered call only, whatever else happens
            refusal = self.orch.refusal(client_of(request.scope))  # full, draining: before any work
            if refusal is not None:
                self.orch.rejected(refusal)
                self.outcomes["refused"] += 1
                code, error, message = refusal
                return http_error(refusal_status(code, error), error, message)
            try:
                sdp, session_config = await self._offer(request)
            except BodyTooLarge as exc:
                self.outcomes["bad_request"] += 1
                return _too_large(exc)
            except ValueError as exc:
                self.outcomes["bad_request"] += 1
                return http_error(400, "invalid_offer", str(exc))
            if secret is not None and secret.session:
                session_config = {**secret.session, **(session_config or {})}
            answer = await self._answer(request, sdp, session_config)
            answered = answer.status_code == 201
            return answer
        finally:
            if not answered:
                self.secrets.give_back(secret)

    async def _offer(self, request: Request) -> tuple[str, dict[str, Any] | None]:
        """The SDP offer and the session config of the request body."""
        body = await read_body(request)
        content_type = request.headers.get("content-type", "")
        kind = content_type.split(";")[0].strip().lower()
        if kind == "application/sdp":
            return body.decode("utf-8", "replace"), None
        if kind != "multipart/form-data":
            raise ValueError(
                "send the offer as application/sdp, or multipart/form-data with 'sdp' and 'session'"
            )
        try:
            parts = _multipart(content_type, body)
        except Exception as exc:
            raise ValueError(f"the multipart body does not parse: {exc}") from None
        if "sdp" not in parts:
            raise ValueError("the multipart body has no 'sdp' part")
        config = None
        if parts.get("session"):
            config = parse_json(parts["session"], "the 'session' part")
            if not isinstance(config, dict):
                raise ValueError("the 'session' part is not a JSON object")
        return parts["sdp"], config

    async def _answer(self, request: Request, sdp: str, config: dict[str, Any] | None) -> Response:
        """The offer checked, then the session opened (admission, its prompt), and only then
        a peer connection: an offer refused costs no aiortc work, no certificate, no socket."""
        client = request.scope.get("client")
        peer = None if self.relay else client[0] if client else None
        offer = webrtc_peer.without_mdns_candidates(sdp)
        candidates = webrtc_peer.candidate_count(offer)
        if candidates > MAX_CANDIDATES:
            self.outcomes["bad_request"] += 1
            over_budget("webrtc_candidates")
            message = f"the offer names {candidates} ICE candidates, more than {MAX_CANDIDATES}"
            return http_error(400, "too_many_candidates", message)
        offer = webrtc_peer.peer_candidates(offer, peer, MAX_CHECKED)
        try:
            _check_sdp(offer)
            parsed = webrtc_peer.SessionDescription.parse(offer)
        except Exception as exc:
            self.outcomes["bad_request"] += 1
            return http_error(400, "invalid_sdp", f"the offer is not valid SDP: {exc}")
        audio = [m for m in parsed.media if m.kind == "audio"]
        if not audio:
            self.outcomes["bad_request"] += 1
            return http_error(400, "no_audio", "the offer has no audio m-line")
        opus = {c.payloadType for c in audio[0].rtp.codecs if c.mimeType.lower() == "audio/opus"}
        if not opus:
            self.outcomes["bad_request"] += 1
            return http_error(400, "no_opus", "the offer's audio does not offer Opus")
        call_id = "rtc_" + secrets.token_hex(12)
        headers = [(k, v) for k, v in request.scope.get("headers", []) if k.lower() != b"authorization"]
        scope = {
            "type": "websocket", "path": "/v1/realtime/calls", "headers": headers, "subprotocols": [],
            "query_string": request.scope.get("query_string", b""), "client": client,
        }  # fmt: skip
        if self._clock is None:
            self._clock = PlayClock(asyncio.get_running_loop())
        call = WebRTCCall(scope, self.config, call_id, self._clock)
        adapter = RealtimeConnection(  # the Realtime protocol on this call
            call, self.orch, self.config, self.codec_pool, self.codec_procs,
            name="webrtc", session_config=config,
        )  # fmt: skip
        task = asyncio.create_task(self._serve(call, adapter), name=f"webrtc-{call_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        outcome = await call.answer  # the handshake: admitted, session.created, its prompt run
        if outcome is not None:
            status, code, message = outcome
            self.outcomes["refused" if status != 400 else "bad_request"] += 1
            return http_error(status, code, message)
        session = call.session
        assert session is not None
        pc = webrtc_peer.new_peer(self.ice_servers)
        try:
            await pc.setRemoteDescription(webrtc_peer.RTCSessionDescription(offer, "offer"))
        except Exception as exc:
            await pc.close()
            self.orch.close(session, "invalid_sdp", errors.POLICY)
            self.outcomes["bad_request"] += 1
            return http_error(400, "invalid_sdp", f"the offer was refused: {exc}")
        call.attach(pc, opus, webrtc_peer.packet_ms(offer, self.config.webrtc_packet_ms))
        try:
            await pc.setLocalDescription(await pc.createAnswer())
        except Exception as exc:
            log.exception("webrtc call %s: no answer", call_id)
            await pc.close()
            self.orch.close(session, "internal_error", errors.INTERNAL)
            self.outcomes["failed"] += 1
            return http_error(500, "answer_failed", f"the server could not answer the offer: {exc}")
        ended = session.closed_event
        if ended is not None or task.done():  # while it was answered: drain, the engine replaced
            await pc.close()
            self.outcomes["refused"] += 1
            reason = ended.reason if ended is not None else "internal_error"
            return http_error(503, reason, f"the session ended before its call was answered: {reason}")
        self.calls[call_id] = call
        self.outcomes["answered"] += 1
        # By id: a timer holding the call would keep a hung-up call's memory until it fires.
        loop = asyncio.get_running_loop()
        loop.call_later(self.config.webrtc_connect_timeout_s, self._unconnected, call_id)
        asked = webrtc_peer.packet_ms(offer, self.config.webrtc_ptime_ms)
        answer = pc.localDescription.sdp
        if asked != 20:  # browsers send 20 ms unless asked
            answer = webrtc_peer.with_audio_attribute(answer, "ptime", asked)
        return Response(
            answer, status_code=201, media_type="application/sdp",
            headers={"Location": f"/v1/realtime/calls/{call_id}"},
        )  # fmt: skip

    def _unconnected(self, call_id: str) -> None:
        """``--webrtc-connect-timeout-s`` after the answer: a call whose peer never came up
        ends, so an offer that never connects holds its slot and UDP socket seconds, not
        until the idle timeout (its session's close tears the peer connection down)."""
        conn = self.calls.get(call_id)
        session = conn.session if conn is not None else None
        if conn is None or conn.connected or session is None or session.closed:
            return
        over_budget("webrtc_connect")
        log.info("webrtc call %s: not connected after %.1f s, ended (connect_timeout)",
                 conn.call_id, self.config.webrtc_connect_timeout_s)  # fmt: skip
        self.orch.close(session, "connect_timeout", errors.NORMAL)

    async def _serve(self, conn: WebRTCCall, adapter: RealtimeConnection) -> None:
        try:
            await conn.run(adapter)
        except Exception:
            log.exception("webrtc call %s failed", conn.call_id)
        finally:
            conn.opened((500, "internal_error", "the call ended before it was answered"))
            self.calls.pop(conn.call_id, None)
            counts, ended = conn.jitter.counts, self.ended_counts
            for name, value in counts.as_dict().items():
                setattr(ended, name, getattr(ended, name) + value)
            self.ended_skipped += conn.frames_skipped
            await conn.teardown()
            # A call is cycles (aiortc's peer connection, its transports and their listeners):
            # collected with the young generations now, a call made and hung up frees its
            # memory at once (~240 KB a call, else held until a full collection; 0.2 ms).
            gc.collect(1)

    async def hangup(self, call_id: str, request: Request) -> Response:
        """``POST /v1/realtime/calls/{id}/hangup``: the session ends (``client_closed``)."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        if not self._server_key_ok(request):
            return http_error(401, "invalid_api_key", "a valid API key is required")
        conn = self.calls.get(call_id)
        if conn is None or conn.session is None:
            return http_error(404, "call_not_found", f"no call {call_id[:64]!r}")
        self.orch.close(conn.session, "client_closed", errors.NORMAL)
        return Response(status_code=200)

    async def client_secret(self, request: Request) -> Response:
        """``POST /v1/realtime/client_secrets``: a short-lived single-use key for one call."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        if not self._server_key_ok(request):
            return http_error(401, "invalid_api_key", "a valid API key is required")
        try:
            spec = parse_json(await read_body(request) or b"{}", "the body")
            session = spec.get("session") if isinstance(spec, dict) else None
            refused = not_served(self.config, session.get("model") if isinstance(session, dict) else None)
            if refused is not None:  # refused now, not when its call comes
                return http_error(404, errors.MODEL_NOT_FOUND, refused)
            secret = self.secrets.mint(spec, self.config.model_name)
        except BodyTooLarge as exc:
            return _too_large(exc)
        except ValueError as exc:
            return http_error(400, "invalid_value", str(exc))
        return JSONResponse(secret.response())

    async def browser_ice_servers(self, request: Request) -> Response:
        """``GET /v1/realtime/ice_servers`` (not OpenAI's): the STUN servers a browser should
        give its RTCPeerConnection to reach this server (webrtc_peer.stun_for_browsers). With
        keys, for a key or a live client secret (not spent: the call it is for spends it)."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        if not self._server_key_ok(request) and not self.secrets.valid(
            auth.presented_keys(request.scope, dict(request.query_params))
        ):
            return http_error(401, "invalid_api_key", "a valid API key or client secret is required")
        return JSONResponse({"ice_servers": webrtc_peer.stun_for_browsers(self.ice_servers)})

    async def close(self) -> None:
        """At shutdown: every call's peer connection closed (its session closes with the rest)."""
        for task in list(self._tasks):
            task.cancel()
        for conn in list(self.calls.values()):
            await conn.teardown()


class WebRTCCollector(Collector):
    """Calls by outcome, live calls, and what the calls' jitter buffers did."""

    def __init__(self, calls: WebRTCCalls) -> None:
        self.calls = calls

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        calls = self.calls
        outcomes = CounterMetricFamily(
            "duplexserve_webrtc_calls", "POST /v1/realtime/calls by outcome", labels=["protocol", "outcome"]
        )
        for outcome in ("answered", "refused", "bad_request", "unauthorized", "forbidden", "failed",
                        "unavailable"):  # fmt: skip
            outcomes.add_metric(["webrtc", outcome], calls.outcomes[outcome])
        yield outcomes
        yield GaugeMetricFamily(
            "duplexserve_webrtc_calls_active", "calls with a live session", len(calls.calls)
        )
        totals = dict(calls.ended_counts.as_dict())
        skipped = calls.ended_skipped
        for conn in calls.calls.values():
            for name, value in conn.jitter.counts.as_dict().items():
                totals[name] += value
            skipped += conn.frames_skipped
        packets = CounterMetricFamily(
            "duplexserve_jitter_packets",
            "incoming audio packets by what the jitter buffer did: packets (received), late, duplicate, "
            "concealed and recovered (20 ms pieces), overflow (dropped, sender ahead), resyncs, skipped "
            "(20 ms pieces passed over unplayed)",
            labels=["protocol", "event"],
        )
        for name, value in totals.items():
            packets.add_metric(["webrtc", name], value)
        yield packets
        yield CounterMetricFamily(
            "duplexserve_webrtc_frames_skipped",
            "input frames not fed to the model because the engine was behind (real time kept)",
            value=skipped,
        )
