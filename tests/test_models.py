"""Model names as vLLM has them: with ``--served-model-name a b``, ``GET /v1/models`` lists a
and b as OpenAI's SDK reads them and a request naming another model is refused
``model_not_found`` on every protocol (a gateway routes on ``?model=``, and a request that
reached the wrong replica must not be served by another model); without it, any name a client
gives is served and echoed (OpenAI's SDKs always send one of their own). And the replica's name
in its resume tokens (``--replica-id``, what nginx routes a resume on)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import websockets.asyncio.client

from duplexserve.config import ServerConfig
from tests.conftest import ServerProcess, start_server

MODEL, ALIAS = "hibiki-zero-3b", "hz3b"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Any:
    server = start_server(str(tmp_path_factory.mktemp("models")), "--max-sessions", "4",
                          "--served-model-name", MODEL, ALIAS, "--replica-id", "duplexserve-7")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def open_server(tmp_path_factory) -> Any:
    """As the README starts it: no --served-model-name."""
    server = start_server(str(tmp_path_factory.mktemp("open")), "--max-sessions", "4")
    yield server
    server.stop()


async def first_and_close(url: str) -> tuple[Any, int | None]:
    """The first message (None: closed before any) and the close code."""
    first = None
    async with websockets.asyncio.client.connect(url, open_timeout=10) as ws:
        with contextlib.suppress(websockets.ConnectionClosed):
            first = await asyncio.wait_for(ws.recv(), 10)
            await asyncio.wait_for(ws.recv(), 10)
    return first, ws.close_code


def listed(server: ServerProcess) -> list[Any]:
    async def go() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=server.http + "/v1", api_key="unused")
        return [m async for m in client.models.list()]

    return asyncio.run(go())


def created_model(server: ServerProcess, path: str, query: str) -> str:
    async def go() -> dict[str, Any]:
        async with websockets.asyncio.client.connect(server.ws(path, query)) as ws:
            return json.loads(await asyncio.wait_for(ws.recv(), 10))

    created = asyncio.run(go())
    assert created["type"] == "session.created"
    return created["session"]["model"] if path == "/v1/realtime" else created["model"]


def test_models_lists_the_served_names_as_openai_clients_read_them(server: ServerProcess) -> None:
    models = listed(server)
    assert [m.id for m in models] == [MODEL, ALIAS]
    assert {(m.object, m.owned_by) for m in models} == {("model", "duplexserve")}
    assert min(m.created for m in models) > 1_700_000_000


@pytest.mark.parametrize("path", ["/v1/duplex", "/v1/realtime", "/api/chat", "/v1/twilio"])
def test_another_model_is_refused_on_every_protocol(server: ServerProcess, path: str) -> None:
    first, code = asyncio.run(first_and_close(server.ws(path, "model=moshi-7b")))
    assert code == 1008
    if path == "/v1/twilio":  # Twilio's protocol has no error message: the close says it
        assert first is None
        return
    if path == "/api/chat":  # Kyutai's protocol: kind 0x05, an error string
        assert isinstance(first, bytes) and first[0] == 5 and b"moshi-7b" in first
        return
    event = json.loads(first)
    assert event["type"] == "error"
    code_of = event["error"]["code"] if path == "/v1/realtime" else event["code"]
    assert code_of == "model_not_found" and ALIAS in json.dumps(event)


@pytest.mark.parametrize("path", ["/v1/duplex", "/v1/realtime"])
def test_each_served_name_is_served_and_echoed(server: ServerProcess, path: str) -> None:
    assert created_model(server, path, f"model={ALIAS}") == ALIAS
    assert created_model(server, path, "") == MODEL  # none named: the first


def test_a_client_secret_for_another_model_is_refused(server: ServerProcess) -> None:
    url = server.http + "/v1/realtime/client_secrets"
    refused = httpx.post(url, json={"session": {"type": "realtime", "model": "moshi-7b"}}, timeout=10)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    minted = httpx.post(url, json={"session": {"type": "realtime", "model": ALIAS}}, timeout=10)
    assert minted.status_code == 200 and minted.json()["session"]["model"] == ALIAS


def test_a_webrtc_offer_for_another_model_is_refused(server: ServerProcess) -> None:
    pytest.importorskip("aiortc")
    from tests.webrtc_client import Peer

    async def go() -> list[tuple[int, Any]]:
        out = []
        for query, session in (("?model=moshi-7b", None), ("", {"type": "realtime", "model": "moshi-7b"}),
                               (f"?model={ALIAS}", None)):
            peer = Peer(np.zeros(24000, np.float32))
            try:
                sdp = await peer.offer()
                async with httpx.AsyncClient(timeout=20) as client:
                    url = server.http + "/v1/realtime/calls" + query
                    if session is None:
                        sdp_type = {"Content-Type": "application/sdp"}
                        response = await client.post(url, content=sdp, headers=sdp_type)
                    else:
                        files = {"sdp": (None, sdp, "application/sdp"),
                                 "session": (None, json.dumps(session))}
                        response = await client.post(url, files=files)
                body = response.json() if response.status_code != 201 else None
                out.append((response.status_code, body))
                if response.status_code == 201:
                    hangup = response.headers["location"] + "/hangup"
                    async with httpx.AsyncClient(timeout=20) as client:
                        await client.post(server.http + hangup)
            finally:
                await peer.close()
        return out

    (first, second, served) = asyncio.run(go())
    for status, body in (first, second):
        assert status == 404 and body["error"]["code"] == "model_not_found", body
    assert served[0] == 201


def test_without_served_names_any_model_is_served_and_echoed(open_server: ServerProcess) -> None:
    (model,) = listed(open_server)
    assert model.id == "synthetic-echo"  # the server's own name
    for path in ("/v1/duplex", "/v1/realtime"):
        assert created_model(open_server, path, "model=gpt-realtime") == "gpt-realtime"

    async def handshake() -> Any:  # Kyutai's protocol: its handshake, kind 0x00
        async with websockets.asyncio.client.connect(open_server.ws("/api/chat", "model=gpt-realtime")) as ws:
            return await asyncio.wait_for(ws.recv(), 10)

    first = asyncio.run(handshake())
    assert isinstance(first, bytes) and first[0] == 0


def test_tokens_name_the_replica(server: ServerProcess) -> None:
    async def go() -> dict[str, Any]:
        async with websockets.asyncio.client.connect(server.ws("/v1/duplex", f"model={MODEL}")) as ws:
            return json.loads(await asyncio.wait_for(ws.recv(), 10))

    assert asyncio.run(go())["resume"]["token"].startswith("duplexserve-7.")


def parsed(*argv: str) -> ServerConfig:
    parser = argparse.ArgumentParser()
    ServerConfig.add_arguments(parser)
    return ServerConfig.from_namespace(parser.parse_args(list(argv)))


def test_served_model_name_reads_as_vllms_flag_and_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parsed("--served-model-name", "a", "b,c")
    assert config.served_model_name == ("a", "b", "c") and config.model_name == "a"
    assert parsed("--model", "b", "--served-model-name", "a", "b").model_name == "b"
    assert parsed().served_model_name == () and parsed("--model", "x").model_name == "x"
    monkeypatch.setenv("DUPLEXSERVE_SERVED_MODEL_NAME", "a, b c")
    assert parsed().served_model_name == ("a", "b", "c")
    with pytest.raises(ValueError, match="not among --served-model-name"):
        parsed("--model", "x", "--served-model-name", "a").validate()


def test_twilio_names_its_model_in_the_path(server: ServerProcess) -> None:
    """Twilio drops a <Stream> URL's query: /v1/twilio/MODEL, the path a gateway routes on, is
    served as ?model=MODEL (audio comes back), and another model's path is refused (1008)."""
    from tests.twilio_client import FakeTwilio

    async def main() -> tuple[int, int | None]:
        served = FakeTwilio(server.ws(f"/v1/twilio/{ALIAS}"))
        await served.open()
        await served.send_audio(bytes([0xFF]) * 640 * 5)
        await served.wait_audio(640)
        await served.close()
        _, code = await first_and_close(server.ws("/v1/twilio/moshi-7b"))
        return len(served.received.audio), code

    got, code = asyncio.run(main())
    assert got >= 640 and code == 1008
