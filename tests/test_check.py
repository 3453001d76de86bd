"""``duplexserve check``: what this machine and these options give, and whether ``serve`` would start.

Real ``python -m duplexserve check`` processes on whatever machine runs the tests (the
CI machine has no GPU). The memory plan's numbers are checked against the tiny engine
itself, built and started in this process.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from typing import Any

import pytest

from duplexserve.check.command import memory_plan
from duplexserve.check.machine import GIB, Gpu, Torch
from duplexserve.check.model import resolve_model
from duplexserve.check.plan import LOAD_SLACK, kv_per_slot, weight_bytes
from duplexserve.check.requirements import Problem
from duplexserve.config import AUTO_SESSIONS, ServerConfig
from duplexserve.engine_bridge.moshi.engine import moshi_engine_from_config
from duplexserve.engine_bridge.moshi.memory import OTHER_PER_SLOT, RESERVE, kv_bytes_per_slot
from tests.duplexserve_cli import hiding
from tests.duplexserve_cli import run as run_duplexserve


def free_port() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def run(*args: str, env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``duplexserve *args`` on a free port: check binds it, and 8998 may be another server's."""
    return run_duplexserve(*args, env={"DUPLEXSERVE_PORT": str(free_port()), **(env or {})}, **kwargs)


def fields(output: str) -> dict[str, str]:
    """The report's ``label  text`` lines, by label."""
    return {line[:13].strip(): line[14:] for line in output.splitlines()[1:]}


def test_the_tiny_preset_on_the_cpu():
    done = run("check", "--engine", "moshi", "--device", "cpu", "--max-sessions", "8",
               "--moshi-kv-layout", "paged")
    assert done.returncode == 0, done.stdout + done.stderr
    report = fields(done.stdout)
    assert report["python"].startswith(f"3.{sys.version_info.minor}.")
    assert report["engine"] == "moshi on cpu (--device cpu) in the engine thread, --max-sessions 8"
    assert report["model"].startswith("preset tiny (random weights and a toy tokenizer): moshi LM 2 layers, "
                                      "d=64, 4 heads, context 200 frames, delay 1")
    assert report["problems"] == "none"  # text with the toy tokenizer, and no prompts to refuse
    # 2 layers x K and V x 200 frames x 64 values x 4 bytes (float32 on the CPU)
    assert report["kv ring"].startswith("200.0 KiB a slot: 2 layers x K,V x 200 frames x 64 values x 4 B")
    # paged: one page of 256 frames holds the 200 of the context; on the CPU every slot holds it whole
    assert report["kv pages"].startswith("paged (--moshi-kv-layout paged): pages of 256 frames, 256.0 KiB")
    assert report["memory"].startswith("the CPU does not size slots by memory: 8 slots x 256.0 KiB of KV")
    assert report["result"] == "serve would start with these options"
    if not os.path.exists("/dev/nvidiactl"):
        assert report["gpus"] == "none (no NVIDIA driver: /dev/nvidiactl is missing)"


def test_the_weights_and_the_kv_ring_are_the_engines():
    """Counted on the meta device from the config, they equal the started engine's own modules."""

    def size(module: Any) -> int:
        tensors = itertools.chain(module.parameters(), module.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    for preset in ("tiny", "tiny-zero"):  # tiny-zero: grouped KV heads (kv_repeat 2)
        config = ServerConfig(engine="moshi", moshi_preset=preset, max_sessions=1, moshi_threads=1,
                              device="cpu")
        model = resolve_model(config)
        counted = weight_bytes(model, "float32")
        engine = moshi_engine_from_config(config)
        engine.start()
        try:
            lm = engine.lm_gen.lm_model
            assert (counted.lm, counted.mimi) == (size(lm), size(engine.mimi)), preset
            attention = lm.transformer.layers[0].self_attn
            kv = kv_bytes_per_slot(len(lm.transformer.layers), attention.embed_dim, attention.num_heads,
                                   attention.context, "bf16", 4, attention.kv_repeat)
            assert kv_per_slot(config, model, "float32") == kv, preset
        finally:
            engine.stop()
    assert kv == 2 * 2 * 200 * (64 // 2) * 4  # half the KV heads, half the ring


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has an NVIDIA driver")
def test_device_cuda_without_a_gpu_says_what_is_missing():
    done = run("check", "--engine", "moshi", "--device", "cuda", "--moshi-preset", "hibiki-2b")
    assert done.returncode == 1
    report = fields(done.stdout)
    assert report["gpus"] == "none (no NVIDIA driver: /dev/nvidiactl is missing)"
    assert report["model"].startswith("preset hibiki-2b (random weights): hibiki LM ")
    assert "bfloat16" in report["kv ring"] and report["memory"].endswith("no usable GPU 0 to fit them in")
    errors = [line for line in done.stdout.splitlines() if line.startswith("  error")]
    assert any("this machine shows no NVIDIA GPU" in line for line in errors), done.stdout
    assert report["result"] == "serve would not start"


def test_a_missing_torch_and_a_missing_checkpoint(tmp_path):
    path, env = hiding(tmp_path, "torch")
    done = run("check", "--engine", "moshi", path=path, env=env)
    assert done.returncode == 1
    report = fields(done.stdout)
    assert report["torch"] == "not installed"
    assert report["memory"] == "no plan: the weights are counted with torch and moshi"
    assert "needs torch, not installed" in done.stdout and "scripts/install-moshi.sh" in done.stdout
    done = run("check", "--engine", "moshi", "--moshi-weights", "/nonexistent/weights")
    assert done.returncode == 1 and fields(done.stdout)["model"] == "none: see the problems below"
    assert "moshi weights folder /nonexistent/weights does not exist" in done.stdout


def test_a_released_repository_without_a_config_leaves_no_moshi_warning(tmp_path):
    """kyutai/moshiko-pytorch-bf16 ships no config.json, as planned: moshi's warning that it
    takes the Moshi 7B defaults came on stderr after the report."""
    done = run("check", "--engine", "moshi", "--moshi-hf-repo", "kyutai/moshiko-pytorch-bf16",
               env={"HF_HUB_CACHE": str(tmp_path)})
    assert done.returncode == 1
    assert "model.safetensors of kyutai/moshiko-pytorch-bf16@main is not in the local Hugging Face cache" \
        in done.stdout
    assert done.stderr == ""


def test_the_synthetic_engine_and_max_sessions_auto_on_the_cpu():
    done = run("check")
    assert done.returncode == 0 and fields(done.stdout)["engine"] == "synthetic (echo): no model, no GPU"
    done = run("check", "--engine", "moshi", "--device", "cpu", "--max-sessions", "auto")
    assert done.returncode == 1
    assert fields(done.stdout)["auto"] == "--max-sessions auto sizes by GPU memory: on the CPU give a number"
    errors = [line for line in done.stdout.splitlines() if line.startswith("  error")]
    assert errors and "--max-sessions auto needs the moshi engine on a GPU" in errors[0], done.stdout


def test_serve_and_check_help_list_the_presets():
    from duplexserve.engine_bridge.moshi.presets import PRESETS

    for command in ("serve", "check"):
        text = "".join(run(command, "--help").stdout.split())  # argparse wraps at the hyphens too
        assert f"oneof{','.join(PRESETS)}[envDUPLEXSERVE_MOSHI_PRESET" in text, command


def gpu_report(sessions: int, free_gib: float, layout: str) -> tuple[dict[str, str], list[Problem]]:
    """The report's GPU lines and problems for a GPU of 8 GiB with ``free_gib`` free."""
    import torch

    config = ServerConfig(engine="moshi", device="cuda", max_sessions=sessions, moshi_kv_layout=layout)
    lines: dict[str, str] = {}
    machine = Torch(torch, gpus=[Gpu(0, "a GPU", 8 * GIB, int(free_gib * GIB))])
    problems = memory_plan(config, resolve_model(config), machine, True, lines.__setitem__)
    return lines, problems


def test_the_plan_on_a_gpu():
    """The GPU's part of the report, for a GPU given here (4 GiB free): the plan the engine checks."""
    def report(sessions: int, free_gib: float) -> tuple[dict[str, str], list[Problem]]:
        return gpu_report(sessions, free_gib, "ring")

    weights = weight_bytes(resolve_model(ServerConfig(engine="moshi")), "bfloat16").total
    per_slot = 2 * 2 * 200 * 64 * 2 + OTHER_PER_SLOT  # the tiny LM's bf16 ring, and the rest of a slot
    fit = (4 * GIB - weights - RESERVE) // per_slot
    auto = (4 * GIB - weights - RESERVE - LOAD_SLACK) // per_slot
    assert (fit, auto) == (63, 47)
    lines, problems = report(64, 4)
    assert lines["memory"].startswith("GPU 0, after the weights: 64 slots x 0.03 GiB (bfloat16 KV ring")
    assert lines["memory"].endswith(f"of 4.0 GiB free; at most {fit} slots fit")
    assert lines["auto"].startswith(f"--max-sessions auto would pick {auto} (keeping 512 MiB")
    assert [p.what.split(":")[0] for p in problems] == ["--max-sessions 64 does not fit on GPU 0"]
    assert problems[0].fix.startswith(f"use --max-sessions {auto} (or auto)")
    assert report(63, 4)[1] == []
    lines, problems = report(AUTO_SESSIONS, 4)
    assert lines["memory"].startswith(f"GPU 0, after the weights: {auto} slots x") and problems == []
    assert report(AUTO_SESSIONS, 2.5)[1][0].what == "--max-sessions auto: no slot fits on GPU 0"


def test_the_paged_plan_on_a_gpu_counts_floors_and_gives_the_pool_the_rest():
    """Paged KV (--moshi-kv-layout paged): a slot costs its floor's pages, auto admits what the
    floors fit, a count past them is refused with the fix, and the report gives the pool's pages; the tiny
    preset's 200-frame context is one 256-frame page."""
    def report(sessions: int, free_gib: float) -> tuple[dict[str, str], list[Problem]]:
        return gpu_report(sessions, free_gib, "paged")

    weights = weight_bytes(resolve_model(ServerConfig(engine="moshi")), "bfloat16").total
    page = 2 * 2 * 256 * 64 * 2  # the tiny LM's bf16 K and V for 256 frames, every layer
    auto = (4 * GIB - weights - RESERVE - page - LOAD_SLACK) // (page + OTHER_PER_SLOT)
    lines, problems = report(AUTO_SESSIONS, 4)
    assert problems == [] and lines["auto"].startswith(f"--max-sessions auto would pick {auto} (")
    assert "(bfloat16 paged KV floor 1 x 256 frames" in lines["memory"]
    spare = 4 * GIB - weights - RESERVE - auto * OTHER_PER_SLOT
    assert f"KV pool {min(1 + auto, spare // page)} pages of 0.1 MiB" in lines["memory"]
    lines, problems = report(auto + 40, 4)
    assert problems[0].what.startswith(f"--max-sessions {auto + 40} does not fit on GPU 0")
    assert "lower --moshi-kv-floor-s" in problems[0].fix


def test_a_prompted_models_plan_counts_its_prompt_cache_and_prefill_row():
    """PersonaPlex's engine holds its prompt cache and the prefill's scratch row (one slot's ring)
    whatever the slot count, and its plan counts them: check and ``--max-sessions auto`` count them
    too, or auto would pick slots that the engine then refuses at start."""
    import torch

    config = ServerConfig(engine="moshi", device="cuda", moshi_preset="tiny-personaplex",
                          max_sessions=AUTO_SESSIONS, prompt_cache_mb=256)
    model = resolve_model(config)
    weights = weight_bytes(model, "bfloat16").total
    kv = kv_per_slot(config, model, "bfloat16")
    lines: dict[str, str] = {}
    machine = Torch(torch, gpus=[Gpu(0, "a GPU", 8 * GIB, 4 * GIB)])
    assert memory_plan(config, model, machine, True, lines.__setitem__) == []
    fixed = 256 * 2**20 + kv
    auto = (4 * GIB - weights - RESERVE - LOAD_SLACK - fixed) // (kv + OTHER_PER_SLOT)
    assert lines["auto"].startswith(f"--max-sessions auto would pick {auto} (")
    assert f"+ {fixed / GIB:.2f} GiB prompt cache and prefill row" in lines["memory"]


def test_a_checkpoint_on_disk(server_factory, tmp_path):
    """check reads its config.json with moshi's loaders; serve reads it in a child process, then starts."""
    from tests.test_moshi_checkpoints import write_checkpoint
    from tests.test_moshi_engine import _tokenizer

    _tokenizer(tmp_path / "spm.model")
    folder = tmp_path / "ckpt"
    write_checkpoint(folder, "tiny", tmp_path / "spm.model")
    done = run("check", "--engine", "moshi", "--moshi-weights", str(folder), "--device", "cpu")
    assert done.returncode == 0, done.stdout
    assert fields(done.stdout)["model"].startswith(f"checkpoint {folder.resolve()}: moshi LM 2 layers, d=64")
    server = server_factory("--engine", "moshi", "--moshi-weights", str(folder), "--max-sessions", "2")
    warned = server.log().splitlines()  # the server logs at warning level: Opus, where libopus is missing
    assert all("libopus" in line for line in warned), warned


def test_options_that_refuse_sessions_the_model_takes_are_reported(tmp_path):
    """PersonaPlex without a tokenizer refuses every text prompt and without voices every
    voice: serve starts all the same, and check said ``problems none``. The tiny preset has
    its toy tokenizer: only the voices are missing."""
    from tests.test_moshi_engine import _tokenizer

    base = ("check", "--engine", "moshi", "--device", "cpu", "--max-sessions", "2")
    done = run(*base, "--moshi-preset", "tiny-personaplex")
    problems = done.stdout.split("problems")[1]
    assert "tokenizer" not in problems and "no voices: every voice prompt is refused" in problems, done.stdout
    base = (*base, "--moshi-preset", "personaplex-7b")  # random weights and no tokenizer
    done = run(*base)
    assert done.returncode == 0, done.stdout
    warned = [line for line in done.stdout.splitlines() if line.startswith("  warning")]
    assert any("every text prompt is refused (invalid_prompt, 1007); pass --moshi-tokenizer" in line
               for line in warned), done.stdout
    assert any("every voice prompt is refused (voice_not_found, 1008)" in line
               and "pass --voice-prompt-dir" in line for line in warned), done.stdout
    _tokenizer(tmp_path / "spm.model")
    (tmp_path / "voices").mkdir()
    done = run(*base, "--moshi-tokenizer", str(tmp_path / "spm.model"), "--voice-prompt-dir",
               str(tmp_path / "voices"))
    assert "holds no voice" in done.stdout and "tokenizer" not in done.stdout.split("problems")[1]
    (tmp_path / "voices" / "NATF2.pt").write_bytes(b"")
    done = run(*base, "--moshi-tokenizer", str(tmp_path / "spm.model"), "--voice-prompt-dir",
               str(tmp_path / "voices"))
    assert "refused" not in done.stdout, done.stdout
    done = run(*base, "--voice-prompt-dir", str(tmp_path / "none"))  # refused as serve refuses it
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"duplexserve check: error: argument --voice-prompt-dir: {tmp_path / 'none'} "
                           "does not exist\n")
    done = run(*base, "--voice-prompt-dir", str(tmp_path / "spm.model"))
    assert done.returncode == 2 and f"{tmp_path / 'spm.model'} is not a folder" in done.stderr
    done = run("check", "--engine", "moshi", "--moshi-preset", "moshi-7b", "--device", "cpu",
               "--max-sessions", "2")  # no prompts to refuse
    assert "no tokenizer: sessions get no text (text.delta);" in done.stdout and "voice" not in done.stdout


def test_a_busy_port_is_a_reason_serve_would_not_start():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run("check", "--port", str(port))
    assert done.returncode == 1
    errors = [line for line in done.stdout.splitlines() if line.startswith("  error")]
    assert errors == [f"  error       cannot listen on 127.0.0.1:{port}: Address already in use; another "
                      "server there? --port picks another"], done.stdout
    assert fields(done.stdout)["result"] == "serve would not start"
    done = run("check", "--host", "192.0.2.1")  # TEST-NET-1: no address of this machine
    assert done.returncode == 1 and "cannot listen on 192.0.2.1:" in done.stdout
    assert "Cannot assign requested address" in done.stdout


def test_a_config_or_lora_beside_a_preset_is_refused(tmp_path):
    """A preset's random weights took neither, without a word: serve started."""
    (tmp_path / "lora.safetensors").write_bytes(b"")
    for flag in ("--moshi-lora", "--moshi-config"):
        done = run("check", "--engine", "moshi", "--moshi-preset", "tiny", "--device", "cpu",
                   "--max-sessions", "1", flag, str(tmp_path / "lora.safetensors"))
        assert done.returncode == 1, done.stdout
        errors = [line for line in done.stdout.splitlines() if line.startswith("  error")]
        said = f"{flag} {tmp_path / 'lora.safetensors'} applies to a checkpoint, and none is named " \
               "(preset tiny)"
        assert errors and f"{said}; name the checkpoint" in errors[0], done.stdout
