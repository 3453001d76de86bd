"""The protocol side of a connection, shared by every protocol: one session, one transport.

A protocol adapter (server/protocols/) subclasses :class:`ProtocolAdapter` and implements
the hooks: ``handshake``, ``on_binary``, ``on_text``, ``render`` (and the fast hooks where
nothing in a message or an answer can wait). What it shares is here: opening the session,
its prompt, the codec hand-offs (inline, on the codec pool, or in a codec worker process,
docs/codecs.md), a received message into the session and onward, an outgoing item on the
wire, and the end. It holds its transport (core/transport.py) and knows nothing of how
the transport moves the data: the transport drives it (``open``, ``receive``,
``send_item``, ``finish``), on the WebSocket's fast path, over ASGI, or on a WebRTC call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from concurrent.futures import Executor
from typing import Any
from urllib.parse import parse_qsl

import numpy as np

from duplexserve import errors
from duplexserve.codecs.formats import FormatError
from duplexserve.codecs.opus_budget import OverBudget
from duplexserve.codecs.pcm import SampleRangeError
from duplexserve.codecs.pipeline import Decoder, Encoder
from duplexserve.codecs.procpool import CodecProcesses
from duplexserve.config import ServerConfig
from duplexserve.errors import SessionError
from duplexserve.server.core import prompts
from duplexserve.server.core.audio_refusals import audio_refused
from duplexserve.server.core.budgets import over_budget
from duplexserve.server.core.client_address import client_of
from duplexserve.server.core.events import AudioOut, ClosedOut, Outgoing
from duplexserve.server.core.orchestrator import Orchestrator
from duplexserve.server.core.session import Session
from duplexserve.server.core.transport import Transport
from duplexserve.server.core.turnaround import FLUSH_FRAMES

log = logging.getLogger(__name__)


def invalid_audio(session: Session, exc: FormatError) -> SessionError:
    """The fatal error that input which cannot be decoded ends its session with; input
    refused for what it would cost (codecs/opus_budget.py) is also counted and logged,
    once: the session ends with it; so is float32 that is not audio (codecs/pcm.py)."""
    if isinstance(exc, OverBudget) and not session.closed:
        over_budget(exc.budget)
        log.warning("session %s closed over its %s budget: %s", session.id, exc.budget, exc)
    elif isinstance(exc, SampleRangeError) and not session.closed:
        audio_refused(exc.reason)
        log.warning("session %s closed for its audio: %s", session.id, exc)
    return SessionError("invalid_audio", str(exc), errors.UNSUPPORTED_DATA)


class ProtocolAdapter:
    """Subclasses implement one wire protocol on top of the session core."""

    protocol = "?"
    #: True: the adapter checks the API key in ``handshake`` itself, because the key comes in
    #: a message after the connection is accepted (Twilio: the ``start`` event).
    deferred_auth = False

    def __init__(
        self,
        transport: Transport,
        orchestrator: Orchestrator,
        config: ServerConfig,
        codec_pool: Executor | None = None,
        codec_procs: CodecProcesses | None = None,
    ) -> None:
        self.transport = transport
        self.scope = transport.scope
        # The transport's sends, bound once: no frame of our own between a render and the wire.
        self.send_bytes = transport.send_bytes
        self.send_text = transport.send_text
        self.close = transport.close
        self.orch = orchestrator
        self.config = config
        self.codec_pool = codec_pool
        #: Inline codecs may run straight in the reader (not under --offload-every-frame).
        self.inline_ok = not config.offload_every_frame
        self.codec_procs = codec_procs  # hosts Opus codecs: pass to make_decoder / make_encoder
        self.query = dict(parse_qsl(self.scope.get("query_string", b"").decode("latin-1")))
        self.session: Session | None = None
        self.decoder: Decoder | None = None
        self.encoder: Encoder | None = None
        self._loop = asyncio.get_running_loop()
        #: When the request came: time to ready is counted from here.
        self.connected_at = self._loop.time()
        #: A resume took the session over while this connection still held it (half-open).
        self.replaced = False
        #: The session's close went out: nothing more is sent.
        self.close_sent = False

    # ------------------------------------------------------------- adapter hooks
    async def handshake(self) -> bool:
        """Accept (or refuse) the connection and open the session; False: refused."""
        raise NotImplementedError

    async def on_binary(self, data: bytes) -> None:
        raise NotImplementedError

    async def on_text(self, text: str) -> None:
        raise NotImplementedError

    async def render(self, item: Outgoing) -> None:
        """Send one outgoing item in this protocol's wire form."""
        raise NotImplementedError

    # Hooks for codecs in a worker process (Opus), where the transport hands a message or
    # an answer to the worker with a callback instead of through ``on_binary`` / ``render``.
    def audio_payload(self, data: bytes) -> bytes | memoryview | None:
        """The bytes of binary message ``data`` for the remote decoder, when the message
        is audio and nothing else; None: ``on_binary`` handles it."""
        return None

    def audio_to_encode(self, item: AudioOut) -> np.ndarray | None:
        """The samples of ``item`` for the remote encoder (any bookkeeping done);
        None: ``render`` handles it."""
        return None

    def send_encoded(self, item: AudioOut, data: bytes | memoryview) -> None:
        """Send ``item`` encoded as ``data`` (what ``render`` does after its encode)."""
        raise NotImplementedError

    def ended(self, item: ClosedOut) -> None:
        """The session ended, whether or not its close reached the client (a dropped socket
        renders nothing): bookkeeping that needs no socket. Called once, as the connection
        ends; not for a session that lives on for a resume."""
        return None

    def binary_now(self, data: bytes) -> bool:
        """Take binary message ``data`` here and now, without ``on_binary``'s coroutine, when
        nothing in it can wait; False: ``on_binary`` (nothing done yet)."""
        return False

    def render_now(self, item: Outgoing) -> bool:
        """Send ``item`` here and now with the transport's synchronous sends, without
        ``render``'s coroutines (four a frame with their eager driver), when nothing in it
        can wait; False: ``render``."""
        return False

    def lost(self, session: Session) -> bool:
        """The connection ended under an open session; True: it was detached for a resume.

        Protocols without resume close it (``disconnected``)."""
        self.orch.close(session, "disconnected", errors.GOING_AWAY)
        return False

    async def send_replaced(self) -> None:
        """The protocol's goodbye to a connection whose session moved to a new one."""
        await self.close(errors.NORMAL, "replaced")

    # -------------------------------------------------------------- the lifecycle
    async def open(self) -> bool:
        """The handshake; True: the session is open and streams."""
        try:
            if not await self.handshake():
                return False
        except (OSError, RuntimeError):  # the client left during it (while a prompt ran, say)
            session = self.session
            if session is not None and not session.closed and not session.detached:
                self.orch.close(session, "disconnected", errors.GOING_AWAY)
            return False
        assert self.session is not None
        return True

    def finish(self) -> None:
        """The connection ended: close a session left open (unless a resume took it) and
        tell the protocol how it ended."""
        session = self.session
        assert session is not None
        if not self.replaced:
            if not session.closed and not session.detached:
                self.orch.close(session, "disconnected", errors.GOING_AWAY)
            self.orch.pump(session)
            if session.closed_event is not None:
                if session.closed_event.reason == "slow_consumer":
                    self._slow_consumer()
                self.ended(session.closed_event)
        if session.timer is not None:
            session.timer.flush()

    def _slow_consumer(self) -> None:
        """Count and say once that this client was closed for not reading what it was sent."""
        over_budget("slow_consumer")
        client = self.scope.get("client")
        log.warning(
            "%s session at %s closed slow_consumer: it read nothing while its answers or replies "
            "passed --max-output-frames or --max-output-event-bytes",
            self.protocol, f"{client[0]}:{client[1]}" if client else "?",
        )  # fmt: skip

    def client_gone(self, session: Session, budget: str | None) -> bool:
        """The connection ended under an open session: ``lost`` (a resume may follow), unless
        the transport closed it for going over ``budget``: then the session ends
        ``over_budget`` and its token with it; the client read the budget in the close frame."""
        if budget is None:
            return self.lost(session)
        self.orch.close(session, "over_budget", errors.POLICY)
        return False

    def take_over(self) -> None:
        """A resume took this connection's session: stop moving its data at once."""
        self.replaced = True
        self.transport.replaced()

    async def say_replaced(self) -> None:
        """Tell a half-open connection it lost its session; never wait long on it."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.send_replaced(), 1.0)

    # ---------------------------------------------------------------- the session
    async def open_session(self, params: dict[str, Any] | None = None) -> bool:
        """Take a slot for this connection, or refuse it in the protocol's own form."""
        client = client_of(self.scope)
        session = self.orch.open_session(params, client)
        if session is None:
            refusal = self.orch.refusal(client)
            code, error, message = refusal or (errors.TRY_AGAIN, "server_unavailable", "try again later")
            await self.refuse(code, error, message)
            return False
        self.session = session
        return True

    async def run_prompt(self, params: dict[str, Any]) -> SessionError | None:
        """Run this session's prompt (``text_prompt``, ``voice_prompt``), before its first audio
        reaches the engine; None once it ran, else what the client is told: an error that ends
        the session unless it is ``prompt_unsupported`` (``prompts.refusal``)."""
        session = self.session
        assert session is not None
        started = self._loop.time()
        outcome: tuple[str, str] | None = ("engine_error", "the session ended before its prompt ran")
        if not session.closed:
            try:
                outcome = await self.orch.run_prompt(session, params)
            except Exception:  # a bridge gone under it, say: this session only
                log.exception("session %s: the prompt could not be run", session.id)
                outcome = ("engine_error", "the engine could not run the prompt")
        self.orch.readiness.observe_prompt(self.protocol, outcome[0] if outcome else "ran",
                                           self._loop.time() - started)
        closed = session.closed_event
        if closed is not None:  # it ended meanwhile (shutdown, the engine replaced): say why
            return SessionError(closed.reason, "the session ended before its prompt ran", closed.close_code)
        return None if outcome is None else prompts.refusal(*outcome)

    async def refuse_session(self, error: SessionError) -> None:
        """Close the session this handshake opened and refuse the connection with ``error``."""
        assert self.session is not None and error.close_code is not None
        self.orch.close(self.session, error.code, error.close_code)
        await self.refuse(error.close_code, error.code, error.message)

    def ready(self) -> None:
        """The session is ready for audio (``session.created``, the handshake byte): observe
        the time since the connection came."""
        self.orch.readiness.observe_ready(self.protocol, self._loop.time() - self.connected_at)

    # ------------------------------------------------------------------- sending
    async def accept(self, subprotocol: str | None = None) -> None:
        await self.transport.accept(subprotocol)

    async def send_json(self, payload: Any) -> None:
        await self.send_text(json.dumps(payload))

    async def refuse(self, code: int, error: str, message: str) -> None:
        """Accept only to say why not, then close: a client can show the reason; unless the
        transport answers a refusal its own way (an HTTP 503 behind a load balancer, the
        answer to a WebRTC offer)."""
        if await self.transport.refuse(code, error, message):
            return
        await self.accept()
        await self.send_error(error, message, fatal=True)
        await self.close(code)

    async def send_error(self, code: str, message: str, fatal: bool) -> None:
        await self.send_json({"type": "error", "code": code, "message": message, "fatal": fatal})

    async def send_item(self, item: Outgoing) -> None:
        """One outgoing item on the wire; after a ClosedOut, the close too."""
        await self.render(item)
        cls = item.__class__
        if cls is AudioOut:
            self.audio_sent()
        elif cls is ClosedOut:
            await self.close(item.close_code, item.reason)  # type: ignore[attr-defined]
            self.close_sent = True

    def audio_sent(self) -> None:
        timer = self.session.timer if self.session is not None else None
        if timer is not None:  # in order: the index is implied
            timer.sent_times.append(self._loop.time())
            if len(timer.sent_times) >= FLUSH_FRAMES:
                timer.flush()

    # ------------------------------------------------------------------- codecs
    async def decode(self, data: bytes) -> np.ndarray:
        decoder = self.decoder
        assert decoder is not None
        if self.config.offload_every_frame:  # the path measured against, never the default
            self.orch.bridge.counts.executor_submissions += 1
            return await self._loop.run_in_executor(None, decoder.decode, data)
        if decoder.inline:
            return decoder.decode(data)
        self.orch.bridge.counts.executor_submissions += 1
        if getattr(decoder, "remote", False):  # state in a codec process (codecs/procpool.py)
            return await decoder.decode_async(data)  # type: ignore[attr-defined]
        return await self._loop.run_in_executor(self.codec_pool, decoder.decode, data)

    async def encode(self, frame: np.ndarray) -> bytes:
        encoder = self.encoder
        assert encoder is not None
        if encoder.inline:
            return encoder.encode(frame)
        self.orch.bridge.counts.executor_submissions += 1
        if getattr(encoder, "remote", False):
            return await encoder.encode_async(frame)  # type: ignore[attr-defined]
        return await self._loop.run_in_executor(self.codec_pool, encoder.encode, frame)

    async def feed(self, samples: np.ndarray) -> None:
        """Decoded model-rate samples into the session, and its ready frames onward."""
        session = self.session
        assert session is not None
        session.receive_audio(samples)
        if self.config.offload_every_frame:
            bridge = self.orch.bridge
            for frame in session.frames_ready():
                await bridge.submit_offloaded((session.slot, session.generation, frame))

    # ----------------------------------------------------------------- receiving
    async def receive(self, data: bytes | str) -> None:
        """One received message through the protocol into the session, and onward."""
        session = self.session
        assert session is not None
        session.last_activity = self._loop.time()
        session.reply_cost = len(data)  # what a reply to it may echo (Session's bound on replies)
        try:
            if len(data) > self.config.max_message_bytes:
                raise SessionError(
                    "message_too_big",
                    f"message of {len(data)} bytes is over the limit of {self.config.max_message_bytes}",
                    errors.TOO_BIG,
                )
            if data.__class__ is str:
                await self.on_text(data)  # type: ignore[arg-type]
            else:
                await self.on_binary(data)  # type: ignore[arg-type]
        except Exception as exc:
            self.receive_failed(session, exc)
        session.reply_cost = 0
        self.received(session)

    def receive_now(self, session: Session, data: bytes) -> bool:
        """``receive`` without its coroutines, when ``binary_now`` takes the message."""
        session.last_activity = self._loop.time()  # the receive time its frames are timed from
        try:
            if not self.binary_now(data):
                return False
        except Exception as exc:
            self.receive_failed(session, exc)
        self.received(session)
        return True

    def received(self, session: Session) -> None:
        """After a message: the session's ready frames to the engine, its answers out."""
        self.orch.pump(session)
        if session.has_outgoing:
            session.notify()

    def receive_failed(self, session: Session, exc: Exception) -> None:
        """Handling a message raised: a SessionError says what to tell the client; anything
        else (a bug, a codec worker gone) is logged and costs this session only, saying
        nothing internal. Called from the except block, so the traceback is logged."""
        if isinstance(exc, SessionError):
            session.error(exc)
        else:
            log.exception("session %s failed", session.id)
            self.orch.close(session, "internal_error", errors.INTERNAL)
