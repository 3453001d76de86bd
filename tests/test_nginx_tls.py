"""wss:// through the shipped nginx: docker/nginx/tls.conf (what docker/compose.tls.yaml adds)
before the site, with a certificate made here, and two real replicas behind it. Sessions open
over TLS, are cut mid-stream and resume over TLS on their own replica, every frame once."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.test_nginx import NGINX, REPLICA, TLS, nginx_in_front
from tests.test_nginx_resume import one_call, replica_name

pytestmark = pytest.mark.skipif(not Path(NGINX).exists(), reason=f"nginx not installed at {NGINX}")


def self_signed(tmp: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, as an operator's would be for the host's name."""
    cert, key = tmp / "tls.crt", tmp / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def test_sessions_and_resumes_over_wss(server_factory, tmp_path, monkeypatch) -> None:
    servers = [server_factory("--max-sessions", "8", "--max-sessions-per-client", "0",
                              "--max-detached", "8", "--replica-id", replica_name(i), *REPLICA)
               for i in range(2)]
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the client trusts it as a CA's

    async def main(url: str) -> None:
        assert url.startswith("wss://")
        clients = await asyncio.gather(*(one_call(url, seed) for seed in range(8)))
        on = [c.created["resume"]["token"].partition(".")[0] for c in clients if c.created]
        assert sorted(set(on)) == ["duplexserve", "duplexserve-1"]

    with nginx_in_front(tmp_path, *servers, tls=TLS(free_port(), cert, key)) as url:
        asyncio.run(main(url))
    for server in servers:
        assert server.metrics()['duplexserve_session_resumes_total{outcome="refused"}'] == 0
