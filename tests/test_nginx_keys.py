"""The shipped nginx keeps keys out of its logs and internal routes off the front door (issue 75).

nginx runs docker/nginx/duplexserve.conf and tls.conf (as docker/compose.tls.yaml adds it) with
the log format and error-log level of the shipped nginx.conf, in front of a real replica that
needs a key and a second replica that is down, so that nginx logs upstream failures. Calls carry
the key as ``?token=`` and as ``Authorization: Bearer``, a resume carries ``?resume=``: none of it
may reach the access log, nor the key the error log.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import websockets
import websockets.asyncio.client

from tests import test_nginx
from tests.conftest import free_port
from tests.test_nginx import NGINX, REPLICA, TLS, Live, nginx_in_front
from tests.test_nginx_tls import self_signed

pytestmark = pytest.mark.skipif(not Path(NGINX).exists(), reason=f"nginx not installed at {NGINX}")

KEY = "sk-nginx-" + secrets.token_hex(12)
RESUME = "duplexserve-1." + secrets.token_hex(12)
ODD_KEY = "sk odd/key+" + secrets.token_hex(4)
MAIN_CONF = test_nginx.SHIPPED_CONF.with_name("nginx.conf")


@dataclass
class Down:
    """A replica that is not running: nothing listens on its port."""

    port: int


def shipped_logging(monkeypatch) -> None:
    """Have the test's nginx log as the shipped nginx.conf says: its access-log format and its
    error-log level (the files stay the test's own)."""
    main = MAIN_CONF.read_text()
    access = re.search(r"^\s*access_log /dev/stdout (\w+);", main, re.M)
    level = re.search(r"^error_log stderr (\w+);", main, re.M)
    assert access and level, f"{MAIN_CONF}: no access_log /dev/stdout FORMAT; or error_log stderr LEVEL;"
    harness = test_nginx.nginx_conf

    def conf(tmp: Path, *args, **kwargs) -> Path:
        path = harness(tmp, *args, **kwargs)
        text, site = path.read_text(), f"include {tmp}/duplexserve.conf;"
        # The format is the site's: the access_log line goes after it, as in nginx.conf.
        for ours, shipped in ((f"access_log {tmp}/access.log upstreams;", ""),
                              (site, f"{site}\n    access_log {tmp}/access.log {access.group(1)};"),
                              ("error.log info;", f"error.log {level.group(1)};")):
            assert text.count(ours) == 1, ours
            text = text.replace(ours, shipped)
        path.write_text(text)
        return path

    monkeypatch.setattr(test_nginx, "nginx_conf", conf)


def test_no_key_or_resume_token_in_nginx_logs_even_when_a_replica_fails(server_factory, tmp_path,
                                                                        monkeypatch) -> None:
    server = server_factory("--api-keys", f"{KEY},{ODD_KEY}", "--max-sessions", "8",
                            "--max-sessions-per-client", "0", *REPLICA)
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    shipped_logging(monkeypatch)
    tls = TLS(free_port(), cert, key)

    async def main(wss: str, ws: str) -> None:
        for url, headers in ((f"{wss}?token={KEY}&model=m", {}), (wss, {"Authorization": f"Bearer {KEY}"}),
                             (f"{ws}?model=m&token={KEY}", {})):
            for _ in range(3):  # least_conn: some go to the replica that is down first, then to ours
                live = await Live.open(url) if not headers else await open_with(url, headers)
                await live.exchange(2)
                assert (await live.finish())["reason"] == "completed"
        # A key that is not URL-safe stays in the URL (nginx cannot decode it), and still works.
        live = await Live.open(f"{wss}?token={quote(ODD_KEY, safe='')}")
        assert (await live.finish())["reason"] == "completed"
        # A resume to the replica that is down: nginx logs the failure, the client gets 503.
        with pytest.raises(websockets.InvalidStatus) as info:
            await Live.open(f"{wss}?token={KEY}&resume={RESUME}&last_frame=3")
        assert info.value.response.status_code == 503

    with nginx_in_front(tmp_path, server, Down(free_port()), tls=tls) as wss:
        ws = f"ws://127.0.0.1:{lb_port(tmp_path)}/v1/duplex"
        asyncio.run(main(wss, ws))
        https = f"https://127.0.0.1:{tls.port}"
        models = httpx.get(https + "/v1/models", params={"token": KEY}, verify=ssl_context(cert), timeout=10)
        assert models.status_code == 200
    access = (tmp_path / "nginx" / "access.log").read_text()
    error = (tmp_path / "nginx" / "error.log").read_text() + (tmp_path / "nginx" / "stderr.log").read_text()
    assert "upstream_status=502" in access  # the replica that is down was tried, and it shows
    assert "resume=***" in access and "/v1/duplex" in access
    for secret in (KEY, RESUME):
        assert secret not in access, access
    assert KEY not in error, error


async def open_with(url: str, headers: dict[str, str]) -> Live:
    ws = await websockets.asyncio.client.connect(url, compression=None, max_size=None, open_timeout=10,
                                                 additional_headers=headers)
    created = json.loads(await asyncio.wait_for(ws.recv(), 10))
    assert created["type"] == "session.created", created
    return Live(ws, created)


def lb_port(tmp: Path) -> int:
    """The site's plaintext port, from the config the harness wrote."""
    match = re.search(r"listen 127\.0\.0\.1:(\d+);", (tmp / "nginx" / "duplexserve.conf").read_text())
    assert match
    return int(match.group(1))


def ssl_context(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


def test_internal_routes_are_not_served_and_plain_http_redirects_to_hsts(server_factory, tmp_path) -> None:
    server = server_factory(*REPLICA)
    cert, key = self_signed(tmp_path)
    tls = TLS(free_port(), cert, key, http_port=free_port())
    with nginx_in_front(tmp_path, server, Down(free_port()), tls=tls):
        site = f"http://127.0.0.1:{lb_port(tmp_path)}"
        https = f"https://127.0.0.1:{tls.port}"
        verify = ssl_context(cert)
        assert httpx.get(server.http + "/metrics", timeout=10).status_code == 200  # the replica's own
        for path in ("/metrics", "/docs", "/redoc", "/openapi.json", "/%6detrics", "/internal/v1/move"):
            for base in (site, https):
                answer = httpx.get(base + path, verify=verify, timeout=10)
                assert answer.status_code == 404, (base, path, answer.status_code)
        front = httpx.get(https + "/v1/models", verify=verify, timeout=10)
        assert front.status_code == 200 and front.json()["data"]
        assert front.headers["strict-transport-security"].startswith("max-age=")
        plain = httpx.get(f"http://127.0.0.1:{tls.http_port}/v1/models?model=m", timeout=10)
        assert plain.status_code == 301
        assert plain.headers["location"] == "https://127.0.0.1/v1/models?model=m"


def test_a_plain_http_call_to_a_failed_replica_leaves_no_key_in_any_nginx_log(server_factory, tmp_path,
                                                                              monkeypatch) -> None:
    """The site's own port, without tls.conf in front: a call with ``?token=`` whose replica is
    down (a resume to it) makes nginx log the failure, and that line must not quote the URL."""
    server = server_factory("--api-keys", KEY, *REPLICA)
    shipped_logging(monkeypatch)

    async def main(ws: str) -> None:
        with pytest.raises(websockets.InvalidStatus) as info:
            await Live.open(f"{ws}?model=m&token={KEY}&resume={RESUME}&last_frame=3")
        assert info.value.response.status_code == 503

    with nginx_in_front(tmp_path, server, Down(free_port())) as ws:
        asyncio.run(main(ws))
    logs = tmp_path / "nginx"
    access = (logs / "access.log").read_text()
    assert "resume=***" in access and "upstream_status=502" in access  # tried, failed, and logged so
    for name in ("error.log", "stderr.log"):
        text = (logs / name).read_text()
        assert KEY not in text and RESUME not in text, (name, text)
