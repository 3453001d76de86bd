"""``duplexserve serve MODEL`` and ``check MODEL``: a folder or a Hugging Face repository named as
``vllm serve`` takes one, its engine and family following from the checkpoint.

Real servers on loopback; the Hub is ``tests/fake_hub.py`` on loopback (``HF_ENDPOINT``), the
cache a temporary ``HF_HOME``: nothing reaches the network.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess, start_server
from tests.duplexserve_cli import run
from tests.fake_hub import COMMIT, FakeHub
from tests.test_check import fields
from tests.test_moshi_server import audio, session

pytest.importorskip("moshi")

REPO = "kyutai/tiny-pytorch-bf16"
CPU = ("--device", "cpu", "--moshi-threads", "1")
# What the tiny checkpoint's loader reads (tests/test_moshi_checkpoints.py's write_checkpoint).
READ = {"config.json", "lm-pytorch-0123abcd@10.safetensors", "mimi-pytorch-e351c8d8@125.safetensors",
        "mimi.json", "spm.model"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """The tiny preset (family moshi) and tiny-hibiki, each laid out as a released repository."""
    from tests.test_moshi_checkpoints import write_checkpoint
    from tests.test_moshi_engine import _tokenizer

    root = tmp_path_factory.mktemp("checkpoints")
    _tokenizer(root / "spm.model")
    write_checkpoint(root / "tiny", "tiny", root / "spm.model")
    write_checkpoint(root / "hibiki", "tiny-hibiki", root / "spm.model")
    return root


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    fake = FakeHub()
    yield fake
    fake.stop()


def hf_env(home: Path, endpoint: str = "http://127.0.0.1:9", **more: str) -> dict[str, str]:
    """A cache of the test's own (HF_HOME holds no stored token either); no token, cache or offline
    switch of the machine's leaks in; ``endpoint``: the Hub (default: a closed loopback port)."""
    env = {"HF_HOME": str(home), "HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0", "HF_TOKEN": "",
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_CACHE": str(home / "hub"),
           "TRANSFORMERS_OFFLINE": "0"}
    return {**env, **more}


def serving(tmp_path: Path, *args: str, env: dict[str, str]) -> ServerProcess:
    """A server of MODEL (the download and two child processes importing torch: a generous wait)."""
    return start_server(str(tmp_path), *args, "--moshi-greedy", *CPU, env=env, timeout=240)


def answers(server: ServerProcess, model_id: str) -> None:
    """It serves the checkpoint: /v1/models names it, and a session runs through the tiny LM."""
    listed = httpx.get(server.http + "/v1/models", timeout=10).json()["data"][0]
    assert listed["id"] == model_id
    out = asyncio.run(session(server.ws(), audio(1, 6)))
    assert out.shape == (7, 1920)


def test_a_folder_is_served_by_the_moshi_engine_its_family_from_its_config(checkpoints, tmp_path):
    done = run("check", str(checkpoints / "hibiki"), *CPU, "--max-sessions", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    report = fields(done.stdout)
    assert report["engine"].startswith("moshi on cpu (--device cpu)"), report
    assert report["model"].startswith(f"checkpoint {(checkpoints / 'hibiki').resolve()}: hibiki LM 2 layers")
    # --max-sessions defaults to auto, which sizes by GPU memory: refused on the CPU, in one line
    done = run("serve", str(checkpoints / "tiny"), *CPU)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "duplexserve serve: --max-sessions auto needs the moshi engine on a GPU (it sizes the slots by the "
        "GPU's free memory); on the CPU pass a number instead, e.g. --max-sessions 8"
    ], done.stderr
    tiny = str(checkpoints / "tiny")
    for bad, said in [((tiny, "--engine", "synthetic"), "is served by the moshi engine"),
                      ((tiny, "--moshi-weights", str(checkpoints)), "both name a checkpoint"),
                      (("./no/such/folder",), "neither a checkpoint folder nor a Hugging Face repository")]:
        done = run("serve", *bad, "--max-sessions", "2")
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
        assert said in done.stderr, done.stderr
    server = serving(tmp_path, str(checkpoints / "tiny"), "--max-sessions", "2", env={})
    try:
        answers(server, "tiny")
    finally:
        server.stop()


def test_a_repository_in_the_cache_is_served_without_asking_the_hub(checkpoints, tmp_path, hub):
    """Already in the cache (its own layout: refs/main, snapshots/COMMIT): no request to the Hub."""
    import shutil

    snapshot = tmp_path / "hf" / "hub" / "models--kyutai--tiny-pytorch-bf16" / "snapshots" / COMMIT
    shutil.copytree(checkpoints / "tiny", snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(COMMIT)
    endpoint = hub.start()
    server = serving(tmp_path, REPO, "--max-sessions", "2", env=hf_env(tmp_path / "hf", endpoint))
    try:
        answers(server, "tiny-pytorch-bf16")
    finally:
        server.stop()
    assert hub.requests == []


def test_a_missing_repository_downloads_only_what_the_checkpoint_reads(checkpoints, tmp_path, hub):
    hub.add_folder(REPO, checkpoints / "tiny")
    hub.repos[REPO]["model-q8.gguf"] = b"another format of the weights, never read"
    # TQDM_POSITION=-1: huggingface_hub's bars even off a terminal (tqdm hides them otherwise)
    env = hf_env(tmp_path / "hf", hub.start(), TQDM_POSITION="-1")
    server = serving(tmp_path, REPO, "--max-sessions", "2", env=env)
    try:
        answers(server, "tiny-pytorch-bf16")
    finally:
        server.stop()
    assert set(hub.files_asked()) == READ
    snapshot = tmp_path / "hf" / "hub" / "models--kyutai--tiny-pytorch-bf16" / "snapshots" / COMMIT
    assert {p.name for p in snapshot.iterdir()} == READ
    bars = [line for line in server.log().replace("\r", "\n").splitlines() if "100%" in line]
    assert any("config.json: 100%" in line for line in bars), server.log()  # a bar a file


def test_a_gated_repository_needs_hf_token(checkpoints, tmp_path, hub):
    gated = "nvidia/tiny-gated"
    hub.add_folder(gated, checkpoints / "tiny")
    hub.gated[gated] = "hf_secret"
    env = hf_env(tmp_path / "hf", hub.start())
    done = run("serve", gated, *CPU, "--max-sessions", "2", "--port", "0", env=env)
    assert done.returncode == 2, done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("duplexserve serve:")]
    assert line.startswith(f"duplexserve serve: {gated} is gated (HF_TOKEN is not set): accept its"), line
    assert "Traceback" not in done.stderr
    done = run("serve", "someone/absent", *CPU, "--max-sessions", "2", "--port", "0", env=env)
    assert done.returncode == 2, done.stderr
    assert "someone/absent is not on the Hugging Face Hub, or is private" in done.stderr
    # the token: sent by huggingface_hub, the repository served
    server = serving(tmp_path, gated, "--max-sessions", "2", env={**env, "HF_TOKEN": "hf_secret"})
    try:
        answers(server, "tiny-gated")
    finally:
        server.stop()
    assert {auth for m, path, auth in hub.requests if gated in path and m == "GET"} == {"Bearer hf_secret"}


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "no-network"])
def test_offline_a_missing_repository_is_one_line_naming_the_fetch(tmp_path, offline):
    """HF_HUB_OFFLINE=1, or a Hub that cannot be reached (a closed loopback port): exit 2, one
    line that names the command fetching it, no traceback."""
    env = hf_env(tmp_path / "hf", "http://127.0.0.1:9", HF_HUB_OFFLINE="1" if offline else "0")
    done = run("serve", f"{REPO}@v2", *CPU, "--max-sessions", "2", "--port", "0", env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [x for x in done.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    why = "HF_HUB_OFFLINE=1 forbids downloading"
    if not offline:
        why = "the Hub (http://127.0.0.1:9) cannot be reached"
    assert lines[0].startswith(
        f"duplexserve serve: config.json of {REPO}@v2 is not in the Hugging Face cache "
        f"({tmp_path / 'hf' / 'hub'}) and {why}: fetch it once with the network on, with "
        f"`duplexserve serve {REPO}@v2`"
    ), lines[0]
    assert f"`huggingface-cli download {REPO} --revision v2`" in lines[0]
    # check never downloads: the same repository is a problem with its fix, not a download
    done = run("check", REPO, *CPU, "--max-sessions", "2", env=env)
    assert done.returncode == 1 and "`duplexserve serve OWNER/NAME` does): huggingface-cli download " \
        f"{REPO}" in done.stdout, done.stdout
