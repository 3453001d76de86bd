"""Resume with no affinity (server/peer_forward.py): a resume that reaches a replica not holding its
session is relayed to the replica its token names.

Three real replicas behind Debian's nginx with a plain round-robin upstream (no map on the token,
no cookie): sessions are cut mid-stream and resumed through nginx, most landing on a replica that
does not hold them. Every resume must land, and every output frame arrive exactly once, in order.
Each replica's ``--replica-id`` is its port, so ``--peer-url-template ws://127.0.0.1:{replica}``
finds it on loopback as ``ws://{replica}:8998`` finds a compose service.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import websockets
import websockets.asyncio.client

from tests import conftest, test_nginx
from tests.conftest import free_port
from tests.resume_client import ResumingClient
from tests.test_nginx import NGINX, REPLICA, nginx_in_front
from tests.test_nginx_resume import generated_site, one_call

REPLICAS = 3
SESSIONS = 100
SECRET = "peer-secret-for-tests"
TEMPLATE = "ws://127.0.0.1:{replica}"


def start_replicas(server_factory: Any, monkeypatch: pytest.MonkeyPatch, count: int,
                   *extra: str) -> list[Any]:
    """Replicas named by their ports, each told where its peers are."""
    ports = [free_port() for _ in range(count)]
    given = iter(ports)
    monkeypatch.setattr(conftest, "free_port", lambda: next(given))
    peers = ("--peer-url-template", TEMPLATE, "--peer-secret", SECRET)
    return [server_factory("--replica-id", str(port), *peers, *extra) for port in ports]


def round_robin_site(out: Path) -> Path:
    """The compose generator's site for three replicas with the routing on the token taken out:
    one plain round-robin pool for every request (the per-replica upstreams stay, unused)."""
    site = generated_site(out).read_text()
    for shipped, plain in (("    least_conn;\n", ""),
                           ("proxy_pass http://$duplexserve_upstream;", "proxy_pass http://duplexserve;")):
        assert site.count(shipped) == 1
        site = site.replace(shipped, plain)
    out.write_text(site)
    return out


@pytest.mark.skipif(not Path(NGINX).exists(), reason=f"nginx not installed at {NGINX}")
def test_every_resume_lands_through_a_round_robin_proxy(server_factory, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("tests.test_nginx_resume.REPLICAS", REPLICAS)
    servers = start_replicas(server_factory, monkeypatch, REPLICAS, "--max-sessions", "40",
                             "--max-sessions-per-client", "0", "--resume-grace-s", "30",
                             "--max-detached", "40", *REPLICA)
    monkeypatch.setattr(test_nginx, "SHIPPED_CONF", round_robin_site(tmp_path / "site.conf"))

    async def main(url: str) -> list[ResumingClient]:
        return await asyncio.gather(*(one_call(url, seed) for seed in range(SESSIONS)))

    with nginx_in_front(tmp_path, *servers) as url:
        clients = asyncio.run(main(url))

    assert len(clients) == SESSIONS
    assert [c.close_code for c in clients] == [1000] * SESSIONS  # the owner's close code, relayed
    totals = {"resumed": 0, "refused": 0, "forwarded": 0, "failed": 0}
    for server in servers:
        metrics = server.metrics()
        totals["resumed"] += metrics['duplexserve_session_resumes_total{outcome="resumed"}']
        totals["refused"] += metrics['duplexserve_session_resumes_total{outcome="refused"}']
        totals["forwarded"] += metrics['duplexserve_resume_forwards_total{outcome="forwarded"}']
        totals["failed"] += metrics['duplexserve_resume_forwards_total{outcome="failed"}']
    assert totals["resumed"] == SESSIONS and totals["refused"] == totals["failed"] == 0, totals
    assert totals["forwarded"] > 0, f"round robin sent no resume to another replica: {totals}"
    assert not any("Traceback" in server.log() for server in servers)


async def refusal(url: str, headers: dict[str, str] | None = None) -> tuple[dict[str, Any], int | None]:
    async with websockets.asyncio.client.connect(url, additional_headers=headers) as ws:
        event = json.loads(await ws.recv())
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
        return event, ws.close_code


def test_the_owners_refusal_is_relayed_as_it_said_it(server_factory, monkeypatch) -> None:
    """The owner's error event (text) and close code come through the relay unchanged; the token,
    not spent by a bad last_frame, then resumes through the other replica."""
    owner, other = start_replicas(server_factory, monkeypatch, 2)

    async def main() -> tuple[dict[str, Any], int | None, dict[str, Any]]:
        ws = await websockets.asyncio.client.connect(f"ws://127.0.0.1:{owner.port}/v1/duplex")
        token = json.loads(await ws.recv())["resume"]["token"]
        ws.transport.abort()  # dropped: the session waits, detached
        via = f"ws://127.0.0.1:{other.port}/v1/duplex?resume={token}"
        event, code = await refusal(f"{via}&last_frame=999")
        async with websockets.asyncio.client.connect(f"{via}&last_frame=-1") as resumed:
            return event, code, json.loads(await resumed.recv())

    event, code, resumed = asyncio.run(main())
    assert code == 1008 and event["code"] == "resume_failed", event
    assert "last_frame must be" in event["message"], event  # the owner's own words
    assert resumed["type"] == "session.resumed", resumed
    assert other.metrics()['duplexserve_resume_forwards_total{outcome="forwarded"}'] == 2
    assert owner.metrics()['duplexserve_session_resumes_total{outcome="resumed"}'] == 1


def test_an_unreachable_owner_and_a_second_hop_are_refused(server_factory, monkeypatch) -> None:
    (server,) = start_replicas(server_factory, monkeypatch, 1)
    base = f"ws://127.0.0.1:{server.port}/v1/duplex"
    gone = free_port()  # no replica listens there

    event, code = asyncio.run(refusal(f"{base}?resume={gone}.abc&last_frame=-1"))
    assert code == 1008 and event["code"] == "resume_failed", event
    assert f"replica '{gone}'" in event["message"] and "could not be reached" in event["message"]

    # A forwarded request: without the fleet's secret it is refused; with it, never forwarded again.
    hop = {"X-Duplexserve-Forwarded-By": "other"}
    event, code = asyncio.run(refusal(f"{base}?resume={server.port}.abc&last_frame=-1",
                                      {**hop, "X-Duplexserve-Peer-Secret": "wrong"}))
    assert code == 1008 and event["code"] == "unauthorized", event
    event, code = asyncio.run(refusal(f"{base}?resume={gone}.abc&last_frame=-1",
                                      {**hop, "X-Duplexserve-Peer-Secret": SECRET}))
    assert code == 1008 and event["code"] == "resume_failed" and "forwarded once" in event["message"], event

    metrics = server.metrics()
    assert metrics['duplexserve_resume_forwards_total{outcome="failed"}'] == 1
    assert metrics['duplexserve_resume_forwards_total{outcome="refused"}'] == 2
    assert metrics['duplexserve_resume_forwards_total{outcome="forwarded"}'] == 0
