"""The fleet on the real CPU image (marker ``docker``), driven from outside the containers
through ports published on 127.0.0.1, as a cluster or an operator would run it:

1. The rendered pod spec of deploy/kubernetes/overlays/hibiki-zero-3b, run with ``docker run``
   as its container says (command, args, env, user and groups, read-only root, no capability,
   no privilege escalation, the spec's volumes), its probes driven at their periods as the
   kubelet drives them, then what a rollout does: the preStop hook (``docker exec``), SIGTERM
   (``docker kill -s TERM``) and the grace (``docker wait`` bounded by it).
2. ``scripts/compose-gpus.py --cpu`` for four GPUs, brought up with docker-compose: four CPU
   replicas behind the nginx image with the generated site, real WebSocket sessions through it.

tests/test_kubernetes_pod.py runs the same spec as a process on this machine; this runs it in
the image that ships. The images come from tests/conftest.py's session fixtures (built once per
run, shared with tests/test_docker_images.py); skips and CI failures as tests/docker_images.py says.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.docker_images import (
    DOCKER_DIR,
    RUN,
    Stopper,
    compose_env,
    draining,
    inspect,
    published,
    ready,
    require_docker,
    require_room,
    sessions,
    sh,
    wait_for,
)
from tests.test_kubernetes import KUBE, RESERVE_S, SECRETS, container_env, one, render
from tests.test_nginx import FAIL_TIMEOUT_WAIT_S, Live, refused_status

# The first test also waits for the builds (2 min idle, 6 under load): a generous limit.
pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]

#: What the base and the CPU and nginx images take on Docker's disk, with their build layers.
CPU_IMAGES_GB = 2


# The session's image fixtures asked for by name, after the checks: named as arguments, pytest
# would set them up (and build) first, before any fixture of a narrower scope.
@pytest.fixture(scope="module")
def cpu(request) -> str:
    require_docker()
    require_room(CPU_IMAGES_GB, "building the CPU and nginx images")
    return request.getfixturevalue("cpu_image")


@pytest.fixture(scope="module")
def nginx(request, cpu) -> str:
    return request.getfixturevalue("nginx_image")


# ------------------------------------------------ the pod spec, run as the kubelet would

OVERLAY = KUBE / "overlays" / "hibiki-zero-3b"
#: The spec's settings that the CPU image cannot take, replaced (no GPU, no checkpoint here):
#: the synthetic engine on the CPU, and 2 slots so that two calls make the pod full.
CPU_ENV = {"DUPLEXSERVE_ENGINE": "synthetic", "DUPLEXSERVE_DEVICE": "cpu", "DUPLEXSERVE_MAX_SESSIONS": "2"}
#: Left out: the moshi engine's own settings (checkpoint, KV cache); the synthetic engine has none.
MOSHI_PREFIX = "DUPLEXSERVE_MOSHI_"
# The other overrides, each where it is applied in run_args: the image (the CPU image for the
# spec's duplexserve:gpu), the GPU limit (not applied), the Hugging Face cache's claim (an empty
# folder, read-only), the container port (published on 127.0.0.1, the pod's IP here).


def quantity(value: str) -> int:
    """A Kubernetes quantity in bytes (binary suffixes, as the spec writes its sizes)."""
    for power, suffix in enumerate(("Ki", "Mi", "Gi", "Ti"), start=1):
        if value.endswith(suffix):
            return int(value[:-2]) * 1024**power
    return int(value)


def run_args(pod: dict[str, Any], container: dict[str, Any], image: str, tmp: Path) -> list[str]:
    """``docker run`` arguments that set the container up as the kubelet does from ``pod``."""
    security = {**pod["securityContext"], **container["securityContext"]}  # the container's win
    assert security["runAsNonRoot"] and security["runAsUser"] != 0  # else the kubelet refuses it
    args = ["--user", f"{security['runAsUser']}:{security['runAsGroup']}",
            "--group-add", str(pod["securityContext"]["fsGroup"])]
    if security.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    if security.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    capabilities = security.get("capabilities", {})
    args += [a for c in capabilities.get("drop", []) for a in ("--cap-drop", c)]
    args += [a for c in capabilities.get("add", []) for a in ("--cap-add", c)]
    # RuntimeDefault is the runtime's own seccomp profile: Docker's default. No service account
    # token and no service links: Docker mounts and sets neither.
    assert security["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False

    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        volume, path = volumes[mount["name"]], mount["mountPath"]
        if volume.get("emptyDir", {}).get("medium") == "Memory":
            size = quantity(volume["emptyDir"]["sizeLimit"])
            args += ["--tmpfs", f"{path}:rw,size={size},mode=1777"]
            continue
        folder = tmp / mount["name"]
        folder.mkdir()
        if "emptyDir" in volume:  # on the node's disk, world-writable as the kubelet makes it
            folder.chmod(0o777)
        elif "secret" in volume:  # the Secret's keys as files (readable by all here: no chown)
            for key, text in SECRETS[volume["secret"]["secretName"]].items():
                (folder / key).write_text(text)
                (folder / key).chmod(0o444)
            folder.chmod(0o755)
        else:  # the claim of the Hugging Face cache: empty here, the synthetic engine reads none
            assert volume["persistentVolumeClaim"]["readOnly"] and mount["readOnly"]
        args += ["--volume", f"{folder}:{path}{':ro' if mount.get('readOnly') else ''}"]
    # The memory limit as the kubelet sets it; the GPU limit has no GPU to give here.
    args += ["--memory", str(quantity(container["resources"]["limits"]["memory"]))]
    args += [a for p in container["ports"] for a in ("--publish", f"127.0.0.1::{p['containerPort']}")]

    env = container_env(container)
    env = {k: v for k, v in env.items() if not k.startswith(MOSHI_PREFIX)} | CPU_ENV
    args += [a for k, v in env.items() for a in ("--env", f"{k}={v}")]
    # command replaces the image's ENTRYPOINT, args its CMD.
    command = container["command"]
    return [*args, "--entrypoint", command[0], image, *command[1:], *container["args"]]


class Prober(threading.Thread):
    """One probe as the kubelet runs it: an HTTP GET every periodSeconds, success a status of
    200-399 within timeoutSeconds; the result turns after successThreshold successes or
    failureThreshold failures in a row (``tripped``: for liveness, a restart)."""

    def __init__(self, spec: dict[str, Any], ports: dict[str, str], passing: bool) -> None:
        super().__init__(daemon=True)
        self.spec, self.passing, self.tripped = spec, passing, False
        self.url = f"http://{ports[spec['httpGet']['port']]}{spec['httpGet']['path']}"
        self.results: list[tuple[float, bool]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        self.halt.wait(self.spec.get("initialDelaySeconds", 0))
        row = 0  # successes (> 0) or failures (< 0) in a row
        while not self.halt.is_set():
            try:
                ok = 200 <= httpx.get(self.url, timeout=self.spec["timeoutSeconds"]).status_code < 400
            except httpx.HTTPError:
                ok = False
            self.results.append((time.monotonic(), ok))
            row = max(row, 0) + 1 if ok else min(row, 0) - 1
            if row >= self.spec.get("successThreshold", 1):
                self.passing = True
            if -row >= self.spec.get("failureThreshold", 3):
                self.passing, self.tripped = False, True
            self.halt.wait(self.spec["periodSeconds"])

    def bound(self) -> float:
        """The longest the kubelet can take to see a change: generous on a loaded machine."""
        s = self.spec
        runs = max(s.get("failureThreshold", 3), s.get("successThreshold", 1))
        return runs * (s["periodSeconds"] + s["timeoutSeconds"]) + 10

    def wait(self, passing: bool) -> None:
        wait_for(f"{self.url} {'passing' if passing else 'failing'}", lambda: self.passing == passing,
                 timeout=self.bound(), every=0.1)

    def passed_since(self, moment: float) -> bool:
        return any(ok for t, ok in self.results if t > moment)


def exec_report(name: str, paths: list[str]) -> dict[str, str]:
    """PID 1's ids, capabilities, no_new_privs and command line, and for each of ``paths``
    whether the container's user can write there ("w") or not ("r")."""
    script = ('grep -E "^(Uid|Gid|Groups|CapEff|NoNewPrivs):" /proc/1/status | tr -s "\\t" " ";'
              ' printf "cmdline: "; tr "\\0" " " </proc/1/cmdline; echo;'
              ' for d in "$@"; do'
              ' if touch "$d/.w" 2>/dev/null; then echo "$d: w"; else echo "$d: r"; fi; done')
    out = sh("docker", "exec", name, "/bin/sh", "-c", script, "sh", *paths).stdout
    return {k: v.strip() for k, _, v in (line.partition(": ") for line in out.splitlines())}


def test_pod_spec_runs_in_the_cpu_image_probes_and_drains_as_the_kubelet_would(cpu, tmp_path) -> None:
    pod = one(render(OVERLAY), "StatefulSet")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    grace = pod["terminationGracePeriodSeconds"]
    name = f"duplexserve-ci-pod-{RUN}"
    sh("docker", "run", "--detach", "--name", name, *run_args(pod, container, cpu, tmp_path))
    probers: list[Prober] = []
    try:
        ports = {p["name"]: published(name, p["containerPort"]) for p in container["ports"]}
        http = ports["http"]

        # Startup probe at its period until it passes, before failureThreshold failures.
        startup = Prober(container["startupProbe"], ports, passing=False)
        probers.append(startup)
        startup.start()
        wait_for("the startup probe", lambda: startup.passing or startup.tripped, timeout=startup.bound())
        assert startup.passing and not startup.tripped, sh("docker", "logs", name, check=False).stderr
        startup.halt.set()
        # Then readiness (not ready until it passes) and liveness, each at its own period.
        readiness = Prober(container["readinessProbe"], ports, passing=False)
        liveness = Prober(container["livenessProbe"], ports, passing=True)
        probers += [readiness, liveness]
        readiness.start()
        liveness.start()
        readiness.wait(True)
        assert ready(http).json()["engine"] == "synthetic"

        # As the spec says: PID 1 is the server (sh exec'd it: SIGTERM reaches it), as the spec's
        # user and group, no capability, no privilege escalation; the root and the claim are
        # read-only, the emptyDirs writable.
        uid, gid = pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]
        mounts = {m["mountPath"]: not m.get("readOnly") for m in container["volumeMounts"]}
        status = exec_report(name, ["/", "/opt", *mounts])
        assert status["Uid"] == f"{uid} {uid} {uid} {uid}" and status["Gid"] == f"{gid} {gid} {gid} {gid}"
        assert status["Groups"] == str(pod["securityContext"]["fsGroup"])
        assert status["CapEff"] == "0000000000000000" and status["NoNewPrivs"] == "1"
        assert status["cmdline"].split()[1:] == ["/opt/duplexserve/bin/duplexserve", "serve"], status
        writable = {path: status[path] == "w" for path in ["/", "/opt", *mounts]}
        assert writable == {"/": False, "/opt": False, **mounts}, status

        async def rollout() -> float:
            key = SECRETS["duplexserve-api-keys"]["api-keys"].splitlines()[-1]
            url = f"ws://{http}/v1/duplex?token={key}"
            live = await Live.open(url)
            await live.exchange(3)
            # Full (2 slots): readiness fails, out of the Service's endpoints; alive all the same.
            other = await Live.open(url)
            await asyncio.to_thread(readiness.wait, False)
            assert (await other.finish())["reason"] == "completed"
            await asyncio.to_thread(readiness.wait, True)

            # The pod is deleted: the grace starts, preStop runs in the container...
            deleted = time.monotonic()
            hook = container["lifecycle"]["preStop"]["exec"]["command"]
            pre_stop = await asyncio.create_subprocess_exec("docker", "exec", name, *hook)
            # ...and the gateways, which learn of it a moment later, still send calls: admitted.
            late = await Live.open(url)
            assert pre_stop.returncode is None, "preStop ended before a call could come in"
            await late.exchange(2)
            assert (await late.finish())["reason"] == "completed"
            assert await pre_stop.wait() == 0
            # Then SIGTERM to PID 1: not ready, a new call refused with 503 before the upgrade
            # (the gateway retries it elsewhere), not dead either: liveness passes, no restart.
            terminated = time.monotonic()
            sh("docker", "kill", "--signal", "TERM", name)
            await asyncio.to_thread(readiness.wait, False)
            assert await refused_status(url) == 503
            # The live call goes on, here until the liveness probe has come once in the drain.
            while not liveness.passed_since(terminated):
                assert time.monotonic() - terminated < liveness.bound(), "no liveness probe in the drain"
                await live.exchange(1)
                await asyncio.sleep(0.5)
            assert not liveness.tripped
            closed = await live.finish()
            assert closed["reason"] == "completed", closed
            assert closed["frames_in"] == closed["frames_out"] == live.sent and closed["frames_dropped"] == 0
            return deleted

        deleted = asyncio.run(rollout())
        # Its last call over, the server exits by itself, 0, long before the kubelet's SIGKILL.
        left = grace - (time.monotonic() - deleted)
        try:
            code = sh("docker", "wait", name, timeout=left).stdout.strip()
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running at the end of the {grace} s grace: the kubelet would kill it")
        assert code == "0" and time.monotonic() - deleted < grace
        assert inspect(name, "{{.State.OOMKilled}} {{.RestartCount}}") == "false 0"
        assert not liveness.tripped
        # The server drained for the grace less the preStop sleep and the margin (the spec's
        # shell computed it from DUPLEXSERVE_TERMINATION_GRACE_S).
        logs = sh("docker", "logs", name)
        assert f"for up to {grace - RESERVE_S} s" in logs.stdout + logs.stderr
    finally:
        for prober in probers:
            prober.halt.set()
        logs = sh("docker", "logs", "--tail", "40", name, check=False)
        sh("docker", "rm", "--force", name, check=False)
        print(logs.stdout, logs.stderr)


# ------------------------------------- four GPUs' compose, on the CPU image behind nginx

REPLICAS = 4
SLOTS = 3


@dataclass
class Fleet:
    compose: list[str]
    env: dict[str, str]
    lb: str  # host:port of nginx
    replicas: list[str]  # host:port of duplexserve, duplexserve-1, ...

    def ws(self, replica: int | None = None) -> str:
        return f"ws://{self.lb if replica is None else self.replicas[replica]}/v1/duplex"

    def container(self, service: str) -> str:
        return sh(*self.compose, "ps", "-q", service, env=self.env).stdout.strip()


@pytest.fixture
def fleet(cpu, nginx, tmp_path) -> Iterator[Fleet]:
    """compose.yaml + compose.cpu.yaml + the override that compose-gpus.py --cpu writes for
    GPUs 0,1,2,3, up with profile scale: four replicas of SLOTS slots and nginx."""
    out = tmp_path / "gpus"
    sh(sys.executable, "scripts/compose-gpus.py", "--cpu", "--gpus", "0,1,2,3", "--out", str(out))
    env = compose_env(tmp_path, REPLICAS, IMAGE=cpu, NGINX_IMAGE=nginx, MAX_SESSIONS=str(SLOTS),
                      DRAIN_GRACE_S="60", MAX_SESSIONS_PER_CLIENT="0")  # every client is this host
    files = (DOCKER_DIR / "compose.yaml", DOCKER_DIR / "compose.cpu.yaml", out / "compose.yaml")
    compose = ["docker-compose", "--project-name", f"duplexserve-ci-gpus-{RUN}", "--profile", "scale",
               *(a for f in files for a in ("-f", str(f)))]
    names = ["duplexserve", *(f"duplexserve-{i}" for i in range(1, REPLICAS))]
    try:
        # `up` waits for every replica to be healthy before it starts nginx (depends_on).
        sh(*compose, "up", "--detach", "--no-build", env=env, timeout=300)
        lb, *replicas = (sh(*compose, "port", s, str(p), env=env).stdout.strip()
                         for s, p in (("lb", 8080), *((n, 8998) for n in names)))
        yield Fleet(compose, env, lb, replicas)
    finally:
        logs = sh(*compose, "logs", "--no-color", "--tail", "30", env=env, check=False)
        print(logs.stdout[-8000:])
        sh(*compose, "down", "--volumes", "--remove-orphans", "--timeout", "5", env=env, check=False,
           timeout=120)


def rejected(http: str) -> float:
    """Sessions a replica has refused (full or draining), from its /metrics."""
    text = httpx.get(f"http://{http}/metrics", timeout=5).text
    return float(next(line.split()[1] for line in text.splitlines()
                      if line.startswith("duplexserve_sessions_rejected_total ")))


def test_four_replicas_compose_on_the_cpu_image_spreads_retries_and_drains(fleet) -> None:
    def counts() -> list[int]:
        return [sessions(r) for r in fleet.replicas]

    async def open_via_lb() -> tuple[Live, int]:
        """A session through nginx, and the replica that took it (whose count went up)."""
        before = counts()
        session = await Live.open(fleet.ws())
        after = counts()
        (replica,) = [i for i in range(REPLICAS) if after[i] == before[i] + 1]
        return session, replica

    async def main() -> Stopper:
        assert [ready(r).json()["max_sessions"] for r in fleet.replicas] == [SLOTS] * REPLICAS
        # least_conn: eight sessions, two on each replica.
        live = [await open_via_lb() for _ in range(8)]
        await asyncio.gather(*(s.exchange(2) for s, _ in live))
        assert counts() == [2, 2, 2, 2]

        # One of replica 0's calls ends, and two clients fill it directly (nginx cannot know):
        # nginx sends the next session to replica 0, holding the fewest of its connections;
        # replica 0 answers 503 and nginx retries it on another replica.
        ended = next(s for s, r in live if r == 0)
        assert (await ended.finish())["reason"] == "completed"
        live = [(s, r) for s, r in live if s is not ended]
        direct = [await Live.open(fleet.ws(0)) for _ in range(2)]
        refused_before = rejected(fleet.replicas[0])
        retried, replica = await open_via_lb()
        assert replica != 0 and rejected(fleet.replicas[0]) == refused_before + 1
        # Two more land on the other two (replica 0, having said 503, is skipped for 2 s).
        more = [await open_via_lb() for _ in range(2)]
        assert sorted(r for _, r in [(retried, replica), *more]) == [1, 2, 3]
        live += [(retried, replica), *more]
        assert counts() == [SLOTS] * REPLICAS
        assert await refused_status(fleet.ws()) == 503  # every replica full: nginx's own 503
        await asyncio.gather(*(s.exchange(2) for s in direct + [s for s, _ in live]))
        await asyncio.sleep(FAIL_TIMEOUT_WAIT_S)  # nginx's fail_timeout for the replicas that said 503

        # Room on replicas 1 and 2; replica 3 is stopped (SIGTERM) with its three calls open.
        for r in (1, 2):
            session = next(s for s, rr in live if rr == r)
            assert (await session.finish())["reason"] == "completed"
            live = [(s, rr) for s, rr in live if s is not session]
        stopper = Stopper(*fleet.compose, "stop", "duplexserve-3")
        stopper.start()
        await asyncio.to_thread(wait_for, "duplexserve-3 draining", lambda: draining(fleet.replicas[3]), 15)
        new = [await open_via_lb() for _ in range(2)]
        assert sorted(r for _, r in new) == [1, 2]  # none to the draining replica
        await asyncio.gather(*(s.exchange(2) for s, _ in new))
        # Replica 3's calls stream on through nginx and end normally.
        held = [s for s, r in live if r == 3]
        assert len(held) == 3
        await asyncio.gather(*(s.exchange(3) for s in held))
        assert stopper.is_alive(), "duplexserve-3 stopped before its calls ended"
        for s in held:
            closed = await s.finish()
            assert closed["reason"] == "completed" and closed["frames_in"] == closed["frames_out"] == s.sent
        for s in [*direct, *(s for s, r in live + new if r != 3)]:
            closed = await s.finish()
            assert closed["reason"] == "completed" and closed["frames_in"] == closed["frames_out"] == s.sent
        return stopper

    replica = fleet.container("duplexserve-3")
    stopper = asyncio.run(main())
    # duplexserve-3 exited by itself, 0, once its calls ended: well inside its 60 s grace,
    # not at its end nor killed at compose's stop_grace_period.
    stopper.join(90)
    assert stopper.result is not None and stopper.result.returncode == 0, stopper.result
    assert stopper.seconds < 30, stopper.seconds
    assert inspect(replica, "{{.State.Running}} {{.State.ExitCode}} {{.State.OOMKilled}}") == "false 0 false"
    assert httpx.get(f"http://{fleet.lb}/lb-health", timeout=5).status_code == 200
