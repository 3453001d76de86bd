"""Resume across replicas: the site scripts/compose-gpus.py writes for four replicas (the shipped
docker/nginx/duplexserve.conf with a line per replica more) in Debian's nginx, before four real
servers, each with its name in its resume tokens (``--replica-id``, as docker/compose.yaml sets it).

100 sessions open through nginx (least_conn spreads them), each is cut mid-stream (the TCP
connection aborted, no close handshake) and resumed through nginx with nothing but its URL, as a
browser's WebSocket can: no header, no cookie. Every resume must reach the replica that holds the
session (any other refuses the token), and every output frame must arrive exactly once, in order.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import test_nginx
from tests.resume_client import ResumingClient
from tests.test_nginx import NGINX, REPLICA, nginx_in_front

ROOT = Path(__file__).resolve().parent.parent
REPLICAS = 4
SESSIONS = 100
FRAMES = 12  # input frames a session, pcm_f32le at 24 kHz: echoed byte for byte
CUT_AFTER = 3  # output frames received before the connection is cut (8 input frames sent)

pytestmark = pytest.mark.skipif(not Path(NGINX).exists(), reason=f"nginx not installed at {NGINX}")


def replica_name(index: int) -> str:
    return "duplexserve" if index == 0 else f"duplexserve-{index}"


def generated_site(out: Path) -> Path:
    """What ``DUPLEXSERVE_GPUS=0,1,2,3 scripts/compose-gpus.py`` writes as the nginx site."""
    spec = importlib.util.spec_from_file_location("compose_gpus", ROOT / "scripts" / "compose-gpus.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out.write_text(module.nginx_site(REPLICAS))
    return out


async def one_call(url: str, seed: int) -> ResumingClient:
    rng = np.random.default_rng(seed)
    chunks = [(rng.random(1920, dtype=np.float32) - 0.5).tobytes() for _ in range(FRAMES)]
    client = ResumingClient(url, chunks)
    await client.open()
    assert client.created is not None and client.created["type"] == "session.created", client.created
    await client.send(8)
    await client.wait_frames(CUT_AFTER)
    client.drop()  # mid-stream: input sent that may not have arrived, output on its way
    first = await client.resume()
    assert first["type"] == "session.resumed", first
    assert first["session_id"] == client.created["session_id"]
    await client.send(FRAMES)
    await client.finish()
    assert client.frames == chunks, "an output frame lost, repeated or out of order"
    closed = client.closed
    assert closed is not None and closed["reason"] == "completed", closed
    assert closed["frames_in"] == closed["frames_out"] == FRAMES and closed["frames_dropped"] == 0
    return client


def test_every_resume_reaches_its_replica_through_nginx(server_factory, tmp_path, monkeypatch) -> None:
    servers = [
        server_factory("--max-sessions", "40", "--max-sessions-per-client", "0", "--resume-grace-s", "30",
                       "--max-detached", "40",
                       "--replica-id", replica_name(i), *REPLICA)
        for i in range(REPLICAS)
    ]
    monkeypatch.setattr(test_nginx, "SHIPPED_CONF", generated_site(tmp_path / "site.conf"))

    async def main(url: str) -> list[ResumingClient]:
        return await asyncio.gather(*(one_call(url, seed) for seed in range(SESSIONS)))

    with nginx_in_front(tmp_path, *servers) as url:
        clients = asyncio.run(main(url))

    created_on = [c.created["resume"]["token"].partition(".")[0] for c in clients if c.created]
    spread = [created_on.count(replica_name(i)) for i in range(REPLICAS)]
    assert min(spread) >= SESSIONS // REPLICAS // 2, f"least_conn did not spread the sessions: {spread}"
    for i, server in enumerate(servers):
        metrics = server.metrics()
        assert metrics['duplexserve_session_resumes_total{outcome="resumed"}'] == spread[i]
        assert metrics['duplexserve_session_resumes_total{outcome="refused"}'] == 0
    # nginx's own record: each resume went to the upstream its token names, on the first try.
    port_of = {replica_name(i): str(s.port) for i, s in enumerate(servers)}
    resumes = [line.split() for line in (tmp_path / "nginx" / "access.log").read_text().splitlines()
               if "resume=" in line]
    assert len(resumes) == SESSIONS
    for uri, status, upstream, *_ in resumes:
        replica = re.search(r"resume=([^.&]+)\.", uri)
        assert replica is not None and status == "101"
        assert upstream == f"127.0.0.1:{port_of[replica.group(1)]}", (uri, upstream)


def test_the_native_client_sends_a_gateways_cookie_back_on_its_resumes(server_factory, tmp_path,
                                                                        monkeypatch) -> None:
    """Envoy Gateway's session persistence (deploy/kubernetes/base/route.yaml) names the replica
    in a cookie on the upgrade's answer; a browser sends it back by itself, and so must
    `duplexserve loadgen --drop-every` (the native client). nginx stands in for the gateway here,
    setting such a cookie; its log shows what each request carried."""
    server = server_factory("--max-sessions", "8", "--max-sessions-per-client", "0", *REPLICA)
    site = generated_site(tmp_path / "site.conf").read_text()
    sticky = '        add_header Set-Cookie "duplexserve-replica=pod-a; Path=/" always;\n'
    site = site.replace("        proxy_pass http://$duplexserve_upstream;\n",
                        "        proxy_pass http://$duplexserve_upstream;\n" + sticky)
    (tmp_path / "site.conf").write_text(re.sub(r"server duplexserve-[123]:8998(?=[ ;])",
                                               f"server 127.0.0.1:{server.port}", site))
    monkeypatch.setattr(test_nginx, "SHIPPED_CONF", tmp_path / "site.conf")
    with nginx_in_front(tmp_path, server) as url:
        load = subprocess.run(
            [sys.executable, "-m", "duplexserve", "loadgen", url.rsplit("/v1", 1)[0], "--concurrency", "4",
             "--sessions", "4", "--warmup", "0", "--seconds", "3", "--drop-every", "1", "--expect", "echo",
             "--no-progress"], capture_output=True, text=True, timeout=120)
    assert load.returncode == 0, load.stdout + load.stderr
    lines = (tmp_path / "nginx" / "access.log").read_text().splitlines()
    resumes = [line for line in lines if "resume=" in line]
    firsts = [line for line in lines if "/v1/duplex" in line and "resume=" not in line]
    assert resumes and len(firsts) == 4
    assert all(line.endswith('"duplexserve-replica=pod-a"') for line in resumes), resumes
    assert all(line.endswith('"-"') for line in firsts), firsts
