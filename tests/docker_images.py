"""What the tests that build and run the Docker images share (marker ``docker``): the build
steps behind tests/conftest.py's session fixtures (one build of each image per test run,
whichever test files ask for it), when to skip, and how to drive a container from outside.

Needs a running Docker engine (Debian's docker.io; .ci/run starts dockerd), mmdebstrap and
docker-compose, and the Debian mirror and the package index that the builds install from.
Without them the tests skip, except under CI (``CI=true``), where they fail: a missing install
step must not pass as a skip. Too little free disk for what a test builds is a skip
(``require_room``): that is the machine's size, not a missing step.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKER_DIR = ROOT / "docker"
RUN = f"{os.getpid()}"
# The legacy builder: it needs nothing from a registry (BuildKit would fetch its
# Dockerfile frontend for a `# syntax=` line, and Debian's docker.io has no buildx).
BUILD_ENV = {**os.environ, "DOCKER_BUILDKIT": "0"}


def sh(*args: str, timeout: float = 600, check: bool = True,
       env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                         env=env, cwd=cwd, check=False)
    if check and out.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    return out


def unusable() -> str | None:
    """Why Docker cannot be used here, or None."""
    for tool, package in (("docker", "docker.io"), ("docker-compose", "docker-compose")):
        if shutil.which(tool) is None:
            return f"{tool} not installed (Debian package {package})"
    if not os.environ.get("DUPLEXSERVE_DOCKER_BASE") and shutil.which("mmdebstrap") is None:
        return "mmdebstrap not installed (Debian package mmdebstrap)"
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                          capture_output=True, text=True, check=False)
    if info.returncode != 0:
        return f"no Docker engine (start dockerd, e.g. scripts/dockerd.sh): {info.stderr.strip()[-300:]}"
    return None


def require_docker() -> None:
    reason = unusable()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must build and run the images: {reason}")
    pytest.skip(reason)


def require_room(gb: float, what: str) -> None:
    """Skip where Docker's disk has less than ``gb`` free for ``what``: a machine without the
    room cannot build it at all (seen on a CI machine with 2 GB free), said in the skip line
    with both figures, rather than failing the run on the build's "no space left on device"."""
    root = sh("docker", "info", "--format", "{{.DockerRootDir}}").stdout.strip()
    free_gb = shutil.disk_usage(root if os.path.isdir(root) else "/").free / 1e9
    if free_gb < gb:
        pytest.skip(f"{what} needs about {gb} GB free in {root}, {free_gb:.1f} GB are")


@dataclass
class Images:
    base: str
    cpu: str
    loadgen: str
    nginx: str
    report: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class Base:
    name: str
    report: dict[str, dict[str, float]] = field(default_factory=dict)  # every build of the run


def image_mb(name: str) -> float:
    return int(sh("docker", "image", "inspect", "--format", "{{.Size}}", name).stdout) / 1e6


def dangling() -> set[str]:
    return set(sh("docker", "images", "-q", "--filter", "dangling=true").stdout.split())


def build_timed(report: dict[str, dict[str, float]], label: str, image: str, *command: str,
                timeout: float = 900) -> None:
    """Run a build command; its time and the image's size go into ``report``."""
    start = time.monotonic()
    sh(*command, env=BUILD_ENV, timeout=timeout)
    report[label] = {"seconds": round(time.monotonic() - start, 1), "mb": round(image_mb(image))}


def record(request, report: dict[str, dict[str, float]], labels: list[str]) -> None:
    """Print the builds of ``labels`` and write every build so far to build/docker-images.json."""
    summary = ", ".join(f"{k} {report[k]['mb']:.0f} MB in {report[k]['seconds']:.0f} s" for k in labels)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\ndocker images built: {summary}")
    (ROOT / "build").mkdir(exist_ok=True)
    (ROOT / "build" / "docker-images.json").write_text(json.dumps(report, indent=1) + "\n")


def remove_images(built: list[str], dangling_before: set[str]) -> None:
    """Remove ``built`` and the untagged images that appeared since, unless told to keep them."""
    if not os.environ.get("DUPLEXSERVE_DOCKER_KEEP") and built:
        sh("docker", "image", "rm", "--force", *built, check=False)
        if dangling() - dangling_before:
            sh("docker", "image", "rm", *(dangling() - dangling_before), check=False)


# ------------------------------------------------- driving containers from outside

def wait_for(what: str, probe, timeout: float = 60.0, every: float = 0.2) -> Any:
    """Call ``probe`` until it returns something true; that value."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, OSError):
            value = probe()
            if value:
                return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def inspect(container: str, template: str) -> str:
    return sh("docker", "inspect", "--format", template, container).stdout.strip()


def published(container: str, port: int) -> str:
    """host:port on 127.0.0.1 that ``port`` of ``container`` is published on."""
    lines = sh("docker", "port", container, f"{port}/tcp").stdout.split()
    return next(a for a in lines if a.startswith("127.0.0.1:"))


def ready(http: str) -> httpx.Response:
    return httpx.get(f"http://{http}/ready", timeout=5)


def sessions(http: str) -> int:
    return int(ready(http).json()["sessions"])


def draining(http: str) -> bool:
    r = ready(http)
    return r.status_code == 503 and r.json()["draining"]


class Stopper(threading.Thread):
    """``docker stop`` (or any stop command) in the background, timed."""

    def __init__(self, *command: str) -> None:
        super().__init__(daemon=True)
        self.command, self.result, self.seconds = command, None, 0.0

    def run(self) -> None:
        start = time.monotonic()
        self.result = subprocess.run(list(self.command), capture_output=True, text=True, check=False)
        self.seconds = time.monotonic() - start


def compose_env(tmp: Path, replicas: int, **settings: str) -> dict[str, str]:
    """docker-compose's environment for compose.yaml + compose.cpu.yaml: this process's
    without DUPLEXSERVE_* and COMPOSE_*, nginx and each of ``replicas`` published on a free
    127.0.0.1 port, empty weights and Hugging Face folders (mounted read-only; not this
    machine's cache), and ``settings`` as DUPLEXSERVE_NAME=value."""
    (tmp / "models").mkdir()
    (tmp / "hf").mkdir()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DUPLEXSERVE_", "COMPOSE_"))}
    ports = {f"DUPLEXSERVE_PUBLISH_PORT{f'_{i}' if i else ''}": "127.0.0.1:" for i in range(replicas)}
    return {
        **clean,
        **ports,
        "DUPLEXSERVE_LB_PORT": "127.0.0.1:",
        "DUPLEXSERVE_WEIGHTS_DIR": str(tmp / "models"),
        "HF_HOME": str(tmp / "hf"),
        # compose's 65536 open files, or this machine's hard limit where that is lower
        "DUPLEXSERVE_NOFILE": str(min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1])),
        **{f"DUPLEXSERVE_{name}": value for name, value in settings.items()},
    }
