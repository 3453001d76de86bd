"""N GPUs on one host from one setting: scripts/compose-gpus.py.

The generator's compose override and nginx site for 2, 4 and 8 GPUs; `docker-compose config`
on compose.yaml with the override (where docker-compose is installed, as in CI); and the
generated site in Debian's nginx before four real server processes (as tests/test_nginx.py
runs the shipped one before two): sessions spread evenly, a full replica's 503 is retried on
another, a draining replica finishes its calls while the other three take the new ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import websockets.asyncio.client
import yaml

from tests import test_nginx
from tests.resume_client import ResumingClient
from tests.test_kubernetes import require_tool
from tests.test_nginx import NGINX, REPLICA, Live, nginx_in_front, refused_status, sessions
from tests.twilio_client import FakeTwilio

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "scripts" / "compose-gpus.py"
SHIPPED_SITE = ROOT / "docker" / "nginx" / "duplexserve.conf"


def generate(out: Path, gpus: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(GENERATOR), "--out", str(out), *flags],
                          env={**os.environ, "DUPLEXSERVE_GPUS": gpus}, capture_output=True, text=True)


def other_lines(site: str) -> list[str]:
    """The lines that are not one per replica."""
    per_replica = ("server duplexserve", "upstream replica-", "~^duplexserve", "# Written")
    return [x for x in site.splitlines() if not x.strip().startswith(per_replica)]


def server_lines(site: str) -> list[str]:
    return [line.strip() for line in site.splitlines() if line.strip().startswith("server duplexserve")]


@pytest.mark.parametrize("gpus", ["0,1", "0,1,2,3", "0,1,2,3,4,5,6,7", "GPU-a1,GPU-b2,GPU-c3"])
def test_one_replica_and_one_upstream_per_gpu(tmp_path, gpus) -> None:
    ids = gpus.split(",")
    assert generate(tmp_path, gpus).returncode == 0
    services = yaml.safe_load((tmp_path / "compose.yaml").read_text())["services"]
    names = ["duplexserve", *(f"duplexserve-{i}" for i in range(1, len(ids)))]
    assert list(services) == [*names, "lb"]
    assert [services[n]["environment"]["NVIDIA_VISIBLE_DEVICES"] for n in names] == ids
    for name in names[2:]:  # whole services, as compose.yaml's duplexserve-1 on their own GPU
        assert services[name]["runtime"] == "nvidia" and services[name]["profiles"] == ["scale"]
    assert list(services["lb"]["depends_on"]) == names
    site = (tmp_path / "duplexserve.conf").read_text()
    assert server_lines(site) == [f"server {n}:8998 max_fails=1 fail_timeout=2s;" for n in names]
    assert [x for x in site.splitlines() if x.startswith("upstream replica-")] == [
        f"upstream replica-{n} {{ server {n}:8998; }}" for n in names]
    assert [x.strip() for x in site.splitlines() if x.strip().startswith("~^")] == [
        f"~^{n}\\. replica-{n};" for n in names]
    assert [services[n]["environment"]["DUPLEXSERVE_REPLICA_ID"] for n in names[2:]] == names[2:]
    # Everything but the server lines is the shipped site.
    shipped = SHIPPED_SITE.read_text()
    assert other_lines(site) == other_lines(shipped)
    # Relative to docker/ (compose's project folder): the override holds no path of this host.
    site_path = os.path.relpath((tmp_path / "duplexserve.conf").resolve(), ROOT / "docker")
    assert services["lb"]["volumes"] == [f"./{site_path}:/etc/nginx/conf.d/default.conf:ro"]


def test_one_gpu_or_a_gpu_twice_is_refused(tmp_path) -> None:
    assert generate(tmp_path, "0").returncode == 2
    assert generate(tmp_path, "0,1,0").returncode == 2
    assert not (tmp_path / "compose.yaml").exists()


def test_cpu_replicas_are_the_cpu_overrides(tmp_path) -> None:
    assert generate(tmp_path, "0,1,2,3", "--cpu").returncode == 0
    services = yaml.safe_load((tmp_path / "compose.yaml").read_text())["services"]
    for i in (2, 3):
        s = services[f"duplexserve-{i}"]
        assert s["runtime"] == "runc" and s["image"] == "${DUPLEXSERVE_IMAGE:-duplexserve:cpu}"
        assert s["environment"]["DUPLEXSERVE_ENGINE"] == "${DUPLEXSERVE_ENGINE:-synthetic}"
        assert s["ports"] == [f"${{DUPLEXSERVE_PUBLISH_PORT_{i}:-127.0.0.1:{8998 + i}}}:8998"]


@pytest.mark.parametrize("cpu", [False, True])
def test_compose_config_accepts_the_override(tmp_path, cpu) -> None:
    compose = shutil.which("docker-compose")
    require_tool(compose, "docker-compose (Debian package docker-compose)")
    out = tmp_path / "gpus"
    assert generate(out, "0,1,2,3", *(["--cpu"] if cpu else [])).returncode == 0
    files = ["docker/compose.yaml", *(["docker/compose.cpu.yaml"] if cpu else []), str(out / "compose.yaml")]
    args = [a for f in files for a in ("-f", f)]
    config = subprocess.run([compose, *args, "--profile", "scale", "config"], cwd=ROOT,
                            capture_output=True, text=True, env={**os.environ, "HF_HOME": str(tmp_path)})
    assert config.returncode == 0, config.stderr
    services = yaml.safe_load(config.stdout)["services"]
    replicas = ["duplexserve", "duplexserve-1", "duplexserve-2", "duplexserve-3"]
    assert sorted(set(services) - {"lb", "lb-exporter", "loadgen"}) == replicas
    assert [services[r]["environment"]["NVIDIA_VISIBLE_DEVICES"] for r in replicas] == ["0", "1", "2", "3"]
    assert {services[r].get("runtime") for r in replicas} == {"runc" if cpu else "nvidia"}
    # Resume with no affinity: each replica's id is its service name, which its peers reach it by.
    for r in replicas:
        environment = services[r]["environment"]
        assert environment["DUPLEXSERVE_REPLICA_ID"] == r
        assert environment["DUPLEXSERVE_PEER_URL_TEMPLATE"].format(replica=r) == f"ws://{r}:8998"


@pytest.mark.skipif(not os.path.exists(NGINX), reason=f"nginx not installed at {NGINX}")
def test_four_replicas_behind_the_generated_site(server_factory, tmp_path, monkeypatch) -> None:
    """Four servers, three slots each, behind nginx with the site generated for four GPUs."""
    servers = [server_factory("--max-sessions", "3", "--drain-grace-s", "60", *REPLICA) for _ in range(4)]
    assert generate(tmp_path / "gpus", "0,1,2,3").returncode == 0
    monkeypatch.setattr(test_nginx, "SHIPPED_CONF", tmp_path / "gpus" / "duplexserve.conf")

    def counts() -> list[int]:
        return [sessions(s) for s in servers]

    async def open_via(url: str) -> tuple[Live, int]:
        """A session through nginx, and the replica that took it (whose count went up)."""
        before = counts()
        session = await Live.open(url)
        after = counts()
        (replica,) = [i for i in range(4) if after[i] == before[i] + 1]
        return session, replica

    async def main(url: str) -> None:
        # least_conn: eight sessions, two on each replica.
        live = [await open_via(url) for _ in range(8)]
        await asyncio.gather(*(s.exchange(2) for s, _ in live))
        assert counts() == [2, 2, 2, 2]
        # Replica 0 filled directly (nginx cannot know): the next three through nginx all land
        # elsewhere, one that nginx sends to replica 0 retried on its 503.
        direct = await Live.open(servers[0].ws())
        live += [await open_via(url) for _ in range(3)]
        assert sorted(r for _, r in live[8:]) == [1, 2, 3]
        assert counts() == [3, 3, 3, 3]
        assert await refused_status(url) == 503  # every replica full
        await asyncio.sleep(test_nginx.FAIL_TIMEOUT_WAIT_S)  # nginx skips a replica that said 503
        # Room on replicas 1 and 2; replica 3 drains (SIGTERM) with its three calls open.
        for replica in (1, 2):
            session = next(s for s, r in live if r == replica)
            assert (await session.finish())["reason"] == "completed"
            live.remove((session, replica))
        servers[3].proc.send_signal(signal.SIGTERM)
        await wait_draining(servers[3])
        new = [await open_via(url) for _ in range(2)]
        assert sorted(r for _, r in new) == [1, 2]  # none to the draining replica
        await asyncio.gather(*(s.exchange(2) for s, _ in new))
        # Replica 3's calls go on and end normally; then it exits by itself.
        draining = [s for s, r in live if r == 3]
        assert len(draining) == 3
        await asyncio.gather(*(s.exchange(3) for s in draining))
        for s in draining:
            closed = await s.finish()
            assert closed["reason"] == "completed" and closed["frames_out"] == s.sent
        assert await asyncio.to_thread(servers[3].proc.wait, 15) == 0
        for s in [direct, *(s for s, r in live + new if r != 3)]:
            assert (await s.finish())["reason"] == "completed"

    with nginx_in_front(tmp_path, *servers) as url:
        asyncio.run(main(url))


async def wait_draining(server) -> None:
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(server.http + "/ready", timeout=2)
        if r.status_code == 503 and r.json()["draining"]:
            return
        assert time.monotonic() < deadline, "never started draining"
        await asyncio.sleep(0.1)


@pytest.mark.skipif(not os.path.exists(NGINX), reason=f"nginx not installed at {NGINX}")
def test_several_models_behind_one_nginx(server_factory, tmp_path, monkeypatch) -> None:
    """--models: four servers, two models, one nginx. ?model= goes to that model's replicas, no
    ?model= to the first model's, an unknown one is refused by them (model_not_found), a
    resume still reaches its replica, and /v1/twilio/MODEL reaches MODEL's replicas."""
    models = ["hibiki-zero-3b", "moshi-7b", "hibiki-zero-3b", "moshi-7b"]
    spec = ",".join(f"{m}=kyutai/{m};DUPLEXSERVE_MOSHI_KV_DTYPE=int8" for m in models)
    assert generate(tmp_path / "gpus", "0,1,2,3", "--cpu", "--models", spec).returncode == 0
    services = yaml.safe_load((tmp_path / "gpus" / "compose.yaml").read_text())["services"]
    names = ("DUPLEXSERVE_MODEL", "DUPLEXSERVE_SERVED_MODEL_NAME")
    envs = [{k: services[n]["environment"][k] for k in names} for n in list(services)[:4]]
    assert envs == [dict.fromkeys(names, m) for m in models]
    # Each server as its service says it: the model's name, served alone.
    servers = [server_factory("--max-sessions", "4", "--replica-id",
                              f"duplexserve-{i}" if i else "duplexserve", *REPLICA, env=e)
               for i, e in enumerate(envs)]
    assert services["duplexserve-3"]["environment"]["DUPLEXSERVE_MOSHI_HF_REPO"] == "kyutai/moshi-7b"
    monkeypatch.setattr(test_nginx, "SHIPPED_CONF", tmp_path / "gpus" / "duplexserve.conf")

    async def main(url: str) -> None:
        live = [await Live.open(f"{url}?model={m}") for m in ["moshi-7b"] * 4 + ["hibiki-zero-3b"] * 2]
        live += [await Live.open(url) for _ in range(2)]  # no model: the first one's
        assert [sessions(s) for s in servers] == [2, 2, 2, 2]
        assert {s.created["model"] for s in live[:4]} == {"moshi-7b"}
        assert {s.created["model"] for s in live[4:]} == {"hibiki-zero-3b"}
        async with websockets.asyncio.client.connect(f"{url}?model=moshika-7b") as ws:
            refused = json.loads(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
        assert refused["code"] == "model_not_found" and ws.close_code == 1008
        client = ResumingClient(f"{url}", [b"\0" * 7680] * 4)
        client.query = "model=moshi-7b"
        await client.open()
        await client.send(2)
        await client.wait_frames(2)
        client.drop()
        assert (await client.resume())["type"] == "session.resumed"
        await client.send(4)
        await client.finish()
        assert len(client.frames) == 4
        for s in live:
            await s.finish()
        # A phone call names its model in the path (Twilio drops the query): each model's call
        # reaches a replica serving it, which would refuse (1008) a call for the other model.
        for model in ["moshi-7b", "hibiki-zero-3b"]:
            call = FakeTwilio(url.replace("/v1/duplex", f"/v1/twilio/{model}"))
            await call.open()
            await call.send_audio(bytes([0xFF]) * 640 * 3)
            await call.wait_audio(640)
            await call.close()

    with nginx_in_front(tmp_path, *servers) as url:
        asyncio.run(main(url))
