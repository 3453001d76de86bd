"""One server, one model: ``GET /v1/models`` as OpenAI's SDK reads it, ``?model=`` of another
model refused with ``model_not_found`` on every protocol (a gateway routes on it, and a request
that reached the wrong replica must not be served by another model), and the replica's name in
its resume tokens (``--replica-id``, what nginx routes a resume on)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import openai
import pytest
import websockets.asyncio.client

from tests.conftest import ServerProcess, start_server

MODEL = "hibiki-zero-3b"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Any:
    server = start_server(str(tmp_path_factory.mktemp("models")), "--max-sessions", "4", "--model", MODEL,
                          "--replica-id", "duplexserve-7")
    yield server
    server.stop()


async def first_and_close(url: str) -> tuple[Any, int | None]:
    async with websockets.asyncio.client.connect(url, open_timeout=10) as ws:
        first = await asyncio.wait_for(ws.recv(), 10)
        with contextlib.suppress(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
    return first, ws.close_code


def test_models_lists_the_one_model_as_openai_clients_read_it(server: ServerProcess) -> None:
    async def go() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=server.http + "/v1", api_key="unused")
        return [m async for m in client.models.list()]

    (model,) = asyncio.run(go())
    assert model.id == MODEL and model.object == "model" and model.owned_by == "duplexserve"
    assert model.created > 1_700_000_000


@pytest.mark.parametrize("path", ["/v1/duplex", "/v1/realtime", "/api/chat"])
def test_another_model_is_refused_on_every_protocol(server: ServerProcess, path: str) -> None:
    first, code = asyncio.run(first_and_close(server.ws(path, "model=moshi-7b")))
    assert code == 1008
    if path == "/api/chat":  # Kyutai's protocol: kind 0x05, an error string
        assert isinstance(first, bytes) and first[0] == 5 and b"moshi-7b" in first
        return
    event = json.loads(first)
    assert event["type"] == "error"
    code_of = event["error"]["code"] if path == "/v1/realtime" else event["code"]
    assert code_of == "model_not_found"


def test_its_own_model_is_served_and_tokens_name_the_replica(server: ServerProcess) -> None:
    async def go() -> dict[str, Any]:
        async with websockets.asyncio.client.connect(server.ws("/v1/duplex", f"model={MODEL}")) as ws:
            return json.loads(await asyncio.wait_for(ws.recv(), 10))

    created = asyncio.run(go())
    assert created["type"] == "session.created" and created["model"] == MODEL
    assert created["resume"]["token"].startswith("duplexserve-7.")
