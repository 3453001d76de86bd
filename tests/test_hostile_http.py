"""A hostile client against the HTTP side and the log (issue 58: items 8-12, 14, 15).

Each test starts a real server and attacks it as the issue did: secrets in the log at
``--log-level debug``, a Twilio callSid that forges log lines, a chunked body of 250 MB,
JSON nested too deep, a POST whose head and body come in one read, a blank key list, and
routes that answered without a key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import subprocess
import sys
import time

import httpx
import websockets.asyncio.client

from tests.conftest import free_port
from tests.native_client import converse
from tests.native_client import signal as noise
from tests.test_reliability import frames_of, open_close_code
from tests.twilio_client import FakeTwilio

KEY = "sk-hostile-" + secrets.token_hex(8)
BEARER = {"Authorization": f"Bearer {KEY}"}


def run(coro):
    return asyncio.run(coro)


def peak_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


async def honest_sessions(server, count: int = 2, frames: int = 40):
    """Sessions streaming in real time beside an attack; each must come back exact."""
    audio = [noise(frames, seed=100 + i) for i in range(count)]
    results = await asyncio.gather(
        *(converse(server.ws(query=f"token={KEY}"), frames_of(a), gap=0.04, timeout=120) for a in audio)
    )
    for a, result in zip(audio, results, strict=True):
        assert b"".join(result.frames) == a.tobytes()
        assert result.closed["reason"] == "completed" and result.close_code == 1000


# ------------------------------------------------------------------------------ the log
def test_the_debug_log_holds_no_key_resume_token_client_secret_or_prompt(server_factory):
    server = server_factory("--api-keys", KEY, "--log-level", "debug")
    prompts = ["persona-" + secrets.token_hex(8) for _ in range(3)]
    seen: list[str] = []  # every token and secret the server handed out

    async def native() -> None:
        url = server.ws(query=f"token={KEY}&text_prompt={prompts[0]}")
        ws = await websockets.asyncio.client.connect(url, compression=None)
        created = json.loads(await ws.recv())
        token = created["resume"]["token"]
        seen.append(token)
        await ws.send(noise(2, seed=1).tobytes())
        await ws.recv()
        ws.transport.abort()  # the connection drops: the session waits for a resume
        bad_resume = server.ws(query=f"resume={token}&last_frame=x")
        refused = await open_close_code(bad_resume, additional_headers=BEARER)
        assert refused[0]["code"] == "resume_failed"  # a refused resume keeps the token: it must not leak
        async with websockets.asyncio.client.connect(
            server.ws(query=f"resume={token}&last_frame=-1"), compression=None, additional_headers=BEARER
        ) as ws:
            resumed = json.loads(await ws.recv())
            assert resumed["type"] == "session.resumed"
            seen.append(resumed["resume"]["token"])
            await ws.send(json.dumps({"type": "input.end"}))
            async for _ in ws:
                pass

    async def realtime() -> None:
        async with websockets.asyncio.client.connect(
            server.ws("/v1/realtime"), subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]
        ) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": {"instructions": prompts[1]}}))
            await ws.recv()

    async def twilio() -> None:
        call = FakeTwilio(server.ws("/v1/twilio"), {"token": KEY, "text_prompt": prompts[2]})
        await call.open()
        await call.stop()
        await call.wait_closed()

    run(native())
    run(realtime())
    run(twilio())
    minted = httpx.post(server.http + "/v1/realtime/client_secrets", headers=BEARER, json={}).json()["value"]
    seen.append(minted)
    assert httpx.get(server.http + f"/v1/realtime/ice_servers?token={minted}").status_code == 200
    assert httpx.get(server.http + "/v1/voices", headers=BEARER).status_code == 200
    time.sleep(0.5)
    log = server.log()
    assert "< authorization:" in log.lower() and "[accepted]" in log  # the header and request lines
    for secret in (KEY, *seen, *prompts):
        assert secret not in log


def test_a_twilio_call_sid_neither_forges_log_lines_nor_floods_the_log(server_factory):
    server = server_factory("--api-keys", KEY, "--log-level", "info")
    forged = "CA1\nFORGED duplexserve: a line the client wrote\r" + "x" * 900_000

    async def call(custom: dict[str, str]) -> int | None:
        twilio = FakeTwilio(server.ws("/v1/twilio"), custom)
        twilio.call_sid = forged
        with contextlib.suppress(websockets.ConnectionClosed):
            await twilio.open()
            await twilio.stop()
        return (await twilio.wait_closed()).close_code

    before = len(server.log())
    assert run(call({})) == 1008  # no key: refused
    assert run(call({"token": KEY})) == 1000  # the right key: served, the callSid logged cut short
    time.sleep(0.3)
    log = server.log()[before:]
    assert not any(line.startswith("FORGED") for line in log.splitlines())
    assert len(log) < 4000


# ------------------------------------------------------------------------- request bodies
def _chunked_flood(port: int, path: str, headers: str, total: int) -> tuple[bytes, int]:
    """POST a chunked body of ``total`` bytes as fast as the socket takes it, looking for the
    answer between chunks; returns (the answer's first bytes, bytes of body sent)."""
    chunk = b"x" * (1 << 20)
    sent, answer = 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}Transfer-Encoding: chunked\r\n\r\n".encode())
        with contextlib.suppress(ConnectionError):
            while sent < total and not answer:
                s.settimeout(30)
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
                s.settimeout(0.001)
                with contextlib.suppress(TimeoutError):
                    answer += s.recv(200)
            if sent >= total:
                s.sendall(b"0\r\n\r\n")
        s.settimeout(60)
        with contextlib.suppress(ConnectionError):
            answer += s.recv(200)
    return answer, sent


def test_a_chunked_body_of_250_mb_is_refused_as_it_streams(server_factory):
    server = server_factory("--api-keys", KEY)
    rss_before = peak_rss_kb(server.proc.pid)
    auth = f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"

    async def attack_beside_honest_sessions() -> tuple[bytes, int]:
        flood = asyncio.create_task(
            asyncio.to_thread(_chunked_flood, server.port, "/v1/realtime/client_secrets", auth, 250 << 20)
        )
        await honest_sessions(server)
        return await flood

    answer, sent = run(attack_beside_honest_sessions())
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    assert sent < 64 << 20  # refused early: the client did not get to send its 250 MB
    assert peak_rss_kb(server.proc.pid) - rss_before < 64 << 10  # KiB: the server kept none of it


def _deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_deeply_nested_json_is_a_400_and_leaves_no_traceback(server_factory):
    server = server_factory("--api-keys", KEY)
    url = server.http + "/v1/realtime/client_secrets"
    for levels in (30_000, 200):  # past Python's stack; within it, past what a session config nests
        answer = httpx.post(url, headers=BEARER, content=f'{{"session": {{"x": {_deep(levels)}}}}}')
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "invalid_value"
    time.sleep(0.2)
    assert "Traceback" not in server.log()


def test_a_failed_call_does_not_spend_its_client_secret(server_factory):
    server = server_factory("--api-keys", KEY)
    with httpx.Client(base_url=server.http, timeout=30) as client:
        secret = client.post("/v1/realtime/client_secrets", headers=BEARER, json={}).json()["value"]

        def offer(session: str) -> httpx.Response:
            return client.post(
                "/v1/realtime/calls", headers={"Authorization": f"Bearer {secret}"},
                files={"sdp": (None, "v=0\r\nnot sdp\r\n"), "session": (None, session)},
            )  # fmt: skip

        deep = offer(json.dumps({"instructions": "hi"})[:-1] + f', "x": {_deep(30_000)}}}')
        assert deep.status_code == 400 and deep.json()["error"]["code"] == "invalid_offer"
        as_secret = f"Authorization: Bearer {secret}\r\n"
        flood, _ = _chunked_flood(server.port, "/v1/realtime/calls", as_secret, 8 << 20)
        assert flood.startswith(b"HTTP/1.1 413 ")
        assert server.metrics()['duplexserve_connections_over_budget_total{budget="request_body"}'] == 1
        # Still good: this request gets past the key to the offer (401 if the secret were spent).
        last = offer("{}")
        assert last.status_code == 400 and last.json()["error"]["code"] == "invalid_sdp"
    time.sleep(0.2)
    assert "Traceback" not in server.log()


def test_a_post_whose_head_and_body_arrive_in_one_read_past_64_kib_is_served(server_factory):
    server = server_factory("--api-keys", KEY)
    body = json.dumps({"session": {"instructions": "x" * 60_000}}).encode()
    head = (
        f"POST /v1/realtime/client_secrets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        f"X-Pad: {'p' * 12_000}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    assert len(head) + len(body) > 70 << 10 and len(head) < 64 << 10
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head + body)  # one write: one read on loopback
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert b'"value":"ek_' in answer


# ------------------------------------------------------------------------------ defaults
def test_a_blank_key_list_is_refused_at_start():
    for blank in (" ", ",", " , "):
        done = subprocess.run(
            [sys.executable, "-m", "duplexserve", "serve", "--port", str(free_port()), "--api-keys", blank],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2
        (line,) = done.stderr.strip().splitlines()
        assert "--api-keys" in line and "names no key" in line


def test_docs_and_ice_servers_need_the_key_metrics_only_when_asked(server_factory):
    server = server_factory("--api-keys", KEY)
    get = httpx.Client(base_url=server.http, timeout=10).get
    for path in ("/docs", "/redoc", "/openapi.json", "/v1/realtime/ice_servers"):
        assert get(path).status_code == 401, path
        assert get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        assert get(path, headers=BEARER).status_code == 200, path
        assert get(path, params={"token": KEY}).status_code == 200, path
    assert f"openapi.json?token={KEY}" in get("/docs", params={"token": KEY}).text  # the page can load it
    for path in ("/", "/static/app.js", "/health", "/ready", "/metrics"):
        assert get(path).status_code == 200, path
    keyed = server_factory("--api-keys", KEY, "--metrics-auth")
    assert httpx.get(keyed.http + "/metrics").status_code == 401
    assert httpx.get(keyed.http + "/metrics", headers=BEARER).status_code == 200


def test_other_origins_are_refused_unless_allowed_and_the_talk_page_origin_works(server_factory):
    server = server_factory()
    own = f"http://127.0.0.1:{server.port}"

    def first_event(srv, origin: str) -> str:
        async def go() -> str:
            async with websockets.asyncio.client.connect(srv.ws(), origin=origin) as ws:
                event = json.loads(await ws.recv())
                return event.get("code") or event["type"]

        return run(go())

    first, code = run(open_close_code(server.ws(), origin="https://evil.example"))
    assert code == 1008 and first["code"] == "origin_not_allowed"
    assert first_event(server, own) == "session.created"
    evil = httpx.post(server.http + "/v1/realtime/client_secrets", headers={"Origin": "https://evil.example"})
    assert evil.status_code == 403
    assert httpx.post(server.http + "/v1/realtime/client_secrets", headers={"Origin": own}).status_code == 200
    allowed = server_factory("--allowed-origins", "https://app.example")
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    answer = httpx.options(allowed.http + "/v1/realtime/calls", headers=preflight)
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == "https://app.example"
    assert first_event(allowed, "https://app.example") == "session.created"
    assert first_event(allowed, "https://evil.example") == "origin_not_allowed"

