"""Detached sessions under a quota per client as well as per server (issue 67, item 5): one
client's dropped sessions evict only its own, never another client's waiting for a resume.

Clients are named by a trusted proxy's ``X-Forwarded-For`` (documentation addresses as header
text only, every packet on loopback); a drop is a TCP abort, no close handshake.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import websockets.asyncio.client

from tests.conftest import ServerProcess
from tests.test_hostile_admission import echoed, opened, refused, run

DETACHED = "duplexserve_sessions_detached"
EVICTED = 'duplexserve_session_resumes_total{outcome="evicted"}'


async def settled(server: ServerProcess, before: dict[str, float]) -> None:
    """Until the server has detached one more session (and evicted any it must for it)."""
    def moved(now: dict[str, float]) -> bool:
        return now[DETACHED] + now[EVICTED] > before[DETACHED] + before[EVICTED]

    deadline = time.monotonic() + 20
    while not moved(await asyncio.to_thread(server.metrics)):
        assert time.monotonic() < deadline, "the server never detached the dropped session"
        await asyncio.sleep(0.02)


async def drop(server: ServerProcess, ws: Any) -> None:
    """Pull the cable under ``ws``; back once the server has detached its session."""
    before = await asyncio.to_thread(server.metrics)
    ws.transport.abort()
    await settled(server, before)


async def live(server: ServerProcess, client: str) -> tuple[Any, str]:
    """A new session of ``client``: its connection and resume token."""
    ws, created = await opened(server, client)
    assert created["type"] == "session.created", created
    return ws, created["resume"]["token"]


async def dropped(server: ServerProcess, client: str, count: int) -> list[str]:
    """``count`` sessions of ``client`` opened and dropped in turn: their tokens."""
    tokens = []
    for _ in range(count):
        ws, token = await live(server, client)
        await drop(server, ws)
        tokens.append(token)
    return tokens


async def resume(server: ServerProcess, client: str, token: str, seed: int) -> str:
    """Resume ``token`` as ``client``: "resumed" once the session went on to echo every frame,
    else the refusal's code."""
    ws = await websockets.asyncio.client.connect(
        server.ws(query=f"resume={token}&last_frame=-1"), additional_headers={"X-Forwarded-For": client}
    )
    first = json.loads(await ws.recv())
    if first["type"] != "session.resumed":
        return (await refused(ws, first))[0]
    return "resumed" if await echoed(ws, seed) else "not exact"


def test_one_clients_drops_evict_only_its_own_detached_sessions(server_factory):
    """The finding: one client opened 64 sessions and dropped them, and every other client's
    detached session was evicted (its resume refused): the pool (a quarter of the slots) was
    the size of one client's quota. Here 16 slots: 4 sessions a client, 4 detached in all, 1
    a client: the attacker's own drops give way to each other."""
    server = server_factory("--max-sessions", "16", "--forwarded-allow-ips", "127.0.0.1")

    async def scenario() -> tuple[list[str], list[str], bool]:
        honest, _ = await live(server, "203.0.113.3")
        streaming = asyncio.create_task(echoed(honest, seed=5, frames=60))  # beside the drops
        waiting = [await dropped(server, client, 1) for client in ("203.0.113.1", "203.0.113.2")]
        attacker = await dropped(server, "198.51.100.66", 4)
        others = [await resume(server, c, t[0], seed=i) for i, (c, t) in
                  enumerate(zip(("203.0.113.1", "203.0.113.2"), waiting, strict=True))]  # fmt: skip
        own = [await resume(server, "198.51.100.66", token, seed=9) for token in attacker]
        return others, own, await streaming

    others, own, exact = run(scenario())
    assert others == ["resumed", "resumed"]
    assert own == ["resume_failed"] * 3 + ["resumed"]  # its last drop kept, its first three evicted
    assert exact
    metrics = server.metrics()
    assert metrics[EVICTED] == 3 and metrics[DETACHED] == 0


def test_under_pressure_the_client_holding_most_gives_way(server_factory):
    """A full pool or full slots used to evict the session detached longest, whoever's it was.
    Now a new session evicts its own client's detached first, else the oldest of the client
    holding the most; a client at its limit with sessions detached gets a new one in place of
    its own oldest, where it was refused. 8 slots, 4 sessions and 2 detached a client."""
    server = server_factory("--max-sessions", "8", "--max-sessions-per-client", "4", "--max-detached", "8",
                            "--forwarded-allow-ips", "127.0.0.1")  # fmt: skip
    b, a, c, d, e = "203.0.113.2", "198.51.100.1", "198.51.100.3", "198.51.100.4", "198.51.100.5"

    async def scenario() -> tuple[list[str], list[str], str, bool]:
        (kept,) = await dropped(server, b, 1)  # detached longest of all
        held = await dropped(server, a, 2)
        full = [(await live(server, c))[0] for _ in range(4)] + [(await live(server, d))[0]]  # 8 slots
        newer = [(await live(server, e))[0]]  # the slot of a's oldest, not b's
        newer.append((await live(server, a))[0])  # a's own other one gives way
        await drop(server, full.pop())  # d: 0 live, 1 detached
        full.append((await live(server, d))[0])  # at no limit, but no slot: its own gives way
        await drop(server, full.pop(0))  # c: 3 live, 1 detached, at its limit of 4
        full.append((await live(server, c))[0])  # admitted: its own detached gives way
        evicted = [await resume(server, a, token, seed=1) for token in held]
        exact = all(await asyncio.gather(*(echoed(ws, seed=10 + i) for i, ws in enumerate(full + newer))))
        return evicted, [await resume(server, b, kept, seed=2)], exact

    evicted, kept, exact = run(scenario())
    assert evicted == ["resume_failed", "resume_failed"]
    assert kept == ["resumed"]
    assert exact
    metrics = server.metrics()
    assert metrics[EVICTED] == 4  # a's two, d's and c's own
    assert metrics.get('duplexserve_connections_over_budget_total{budget="sessions_per_client"}', 0) == 0
