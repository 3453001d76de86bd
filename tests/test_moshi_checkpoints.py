"""Checkpoints in the released layout load as moshi loads them and answer as moshi.server does.

Each tiny variant (one per feature the released configs use: Hibiki's conditioning, weight
schedules, low-rank embeddings, 16 depformer steps, grouped KV heads, ``rope_concat``,
depformer norms, LoRA, old fused key names) is written to disk as Kyutai publishes a
checkpoint (config.json, safetensors, SentencePiece model). The engine serves it through
``--moshi-weights``/``--moshi-hf-repo``; the reference loads the same files with moshi's
``CheckpointInfo`` and runs moshi.server's batch-1 loop (``reference.server_loop``):
greedy, float64, every token equal.
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

from duplexserve.engine_bridge.moshi.checkpoint import CheckpointSource, preset_checkpoint, resolve_checkpoint
from duplexserve.engine_bridge.moshi.engine import MoshiEngine, Sampling, _calibrate_codebooks
from duplexserve.engine_bridge.moshi.presets import get_preset
from duplexserve.engine_bridge.moshi.reference import server_loop
from tests.test_moshi_engine import _tokenizer
from tests.test_moshi_equivalence import CONTEXT, run_sessions

# (slot, first step, frames, steps skipped): slot 1 is taken again after its first session
SESSIONS = [(0, 0, 20, ()), (1, 2, 5, ()), (2, 3, 9, (6,)), (1, 8, 6, ())]
LM_NAME = "lm-pytorch-0123abcd@10.safetensors"
LORA = {"lora": True, "lora_rank": 4, "lora_scaling": 2.0}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spm") / "spm.model"
    _tokenizer(path)
    return path


def write_checkpoint(folder: Path, preset: str, tokenizer: Path, fused_names: bool = False) -> dict:
    """The preset with random weights, laid out as a released repository; its config."""
    import torch
    from safetensors.torch import save_file

    p = get_preset(preset)
    torch.manual_seed(7)
    info = preset_checkpoint(p)
    mimi = info.get_mimi()
    _calibrate_codebooks(mimi)
    lm = info.get_moshi(dtype=torch.float32, load_weight=False)
    state = lm.state_dict()
    if fused_names:  # the older layout: per-step projections stacked in one tensor
        state = fuse_projections(state)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / LM_NAME))
    save_file(mimi.state_dict(), str(folder / "mimi-pytorch-e351c8d8@125.safetensors"))
    (folder / "mimi.json").write_text(json.dumps(p.mimi))
    (folder / "spm.model").write_bytes(tokenizer.read_bytes())
    config = {
        **p.lm, "context": CONTEXT, "model_type": p.model_type, "lm_gen_config": p.lm_gen_config,
        "moshi_name": LM_NAME, "mimi_name": "mimi-pytorch-e351c8d8@125.safetensors",
        "mimi_config_name": "mimi.json", "tokenizer_name": "spm.model",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return config


def fuse_projections(state: dict) -> dict:
    """``in_projs.{i}.weight`` -> ``in_proj_weight``, ``out_projs.{i}.weight`` -> ``out_proj.weight``."""
    import torch

    fused: dict = {}
    for key, value in state.items():
        match = re.match(r"(.*\.self_attn\.)(in|out)_projs\.(\d+)\.weight$", key)
        if match is None:
            fused[key] = value
            continue
        name = match[1] + ("in_proj_weight" if match[2] == "in" else "out_proj.weight")
        fused.setdefault(name, []).append((int(match[3]), value))
    return {k: torch.cat([w for _, w in sorted(v)]) if isinstance(v, list) else v for k, v in fused.items()}


def moshi_models(folder: Path, lora: Path | None = None) -> tuple:
    """moshi's own loading of the folder's files (no duplexserve code): Mimi, LM, model_type."""
    import torch
    from moshi.models import loaders

    config = json.loads((folder / "config.json").read_text())
    info = loaders.CheckpointInfo.from_hf_repo(
        "unused/offline",
        moshi_weights=folder / config["moshi_name"],
        mimi_weights=folder / config["mimi_name"],
        tokenizer=folder / config["tokenizer_name"],
        config_path=folder / "config.json",
        mimi_config_path=folder / config["mimi_config_name"],
        lora_weights=lora,
    )
    mimi = info.get_mimi().double()
    return mimi, info.get_moshi(dtype=torch.float64, fuse_lora=True), info.model_type


def engine_for(folder: Path, **kwargs) -> MoshiEngine:
    engine = MoshiEngine(
        4, weights=str(folder), sampling=Sampling(greedy=True), threads=1, dtype="float64", **kwargs
    )
    engine.start()
    return engine


def assert_serves_as_moshi(engine: MoshiEngine, models: tuple, cfg_coef: float = 1.0) -> None:
    outputs, tokens, inputs = run_sessions(engine, SESSIONS)
    for out, tok, x in zip(outputs, tokens, inputs, strict=True):
        ref_audio, ref_tokens = server_loop(models, x, cfg_coef)
        np.testing.assert_array_equal(tok, ref_tokens)
        np.testing.assert_allclose(out, ref_audio, rtol=0, atol=1e-6)


# (preset, old fused key names, --moshi-cfg-coef, fast paths that apply: live attention, lean depformer)
VARIANTS = [
    ("tiny", True, 1.0, (True, True)),
    ("tiny-hibiki", False, 1.0, (True, True)),
    ("tiny-hibiki", True, 3.0, (True, True)),
    ("tiny-zero", False, 1.0, (True, True)),  # grouped KV heads, rope_concat, depformer norms
]


@pytest.mark.parametrize("preset,fused_names,cfg_coef,fast", VARIANTS)
def test_a_released_layout_serves_as_moshi_server(
    tmp_path, tokenizer, caplog, preset, fused_names, cfg_coef, fast
):
    from duplexserve.engine_bridge.moshi.lean_depformer import LeanStepAttention
    from duplexserve.engine_bridge.moshi.live_lm import LiveAttention

    write_checkpoint(tmp_path, preset, tokenizer, fused_names)
    with caplog.at_level(logging.WARNING):
        engine = engine_for(tmp_path, cfg_coef=cfg_coef)
    try:
        lm = engine.lm_gen.lm_model
        assert isinstance(lm.transformer.layers[0].self_attn, LiveAttention) == fast[0]
        assert isinstance(lm.depformer.layers[0].self_attn, LeanStepAttention) == fast[1]
        assert ("cannot use live-prefix attention" in caplog.text) != fast[0]
        assert ("cannot take the unmasked attention" in caplog.text) != fast[1]
        if engine.model_type == "hibiki":  # moshi's mutation: an early EOS is fed back as PAD
            assert (lm.text_emb.weight[2] == lm.text_emb.weight[3]).all()
        assert_serves_as_moshi(engine, moshi_models(tmp_path), cfg_coef)
    finally:
        engine.stop()


def test_a_lora_checkpoint_is_the_base_with_the_adapter_fused(tmp_path, tokenizer):
    import torch
    from moshi.models import loaders
    from moshi.modules.lora import LoRALinear, replace_all_linear_with_lora
    from safetensors.torch import load_file, save_file

    config = write_checkpoint(tmp_path, "tiny", tokenizer)
    base = load_file(str(tmp_path / LM_NAME))
    lm_kwargs = {k: config[k] for k in get_preset("tiny").lm}
    lm = loaders.get_moshi_lm(None, lm_kwargs=lm_kwargs, dtype=torch.float32)
    replace_all_linear_with_lora(lm, LORA["lora_rank"], LORA["lora_scaling"])
    torch.manual_seed(3)
    adapter, fused = {}, dict(base)
    for name, module in lm.named_modules():
        if isinstance(module, LoRALinear):
            a, b = torch.randn_like(module.lora_A.weight), torch.randn_like(module.lora_B.weight) * 0.01
            adapter |= {f"{name}.lora_A.weight": a, f"{name}.lora_B.weight": b}
            update = LORA["lora_scaling"] * (b.double() @ a.double())
            fused[f"{name}.weight"] = base[f"{name}.weight"].double() + update
    save_file(adapter, str(tmp_path / "lora.safetensors"))
    (tmp_path / "consolidated.json").write_text(json.dumps({**config, **LORA}))

    with pytest.raises(ValueError, match="LoRA"):  # an adapter without the config that says so
        MoshiEngine(1, weights=str(tmp_path), lora=str(tmp_path / "lora.safetensors"))
    with pytest.raises(ValueError, match="LoRA"):  # a LoRA config without its adapter
        MoshiEngine(1, weights=str(tmp_path), config=str(tmp_path / "consolidated.json"))
    engine = engine_for(
        tmp_path, config=str(tmp_path / "consolidated.json"), lora=str(tmp_path / "lora.safetensors")
    )
    try:
        served = engine.lm_gen.lm_model.state_dict()
        for key, value in fused.items():
            torch.testing.assert_close(served[key].double(), value.double(), rtol=1e-12, atol=1e-12)
        assert not any(isinstance(m, LoRALinear) for m in engine.lm_gen.lm_model.modules())
    finally:
        engine.stop()


def test_a_missing_file_is_an_error_that_names_it(tmp_path, tokenizer):
    write_checkpoint(tmp_path, "tiny", tokenizer)
    (tmp_path / "mimi-pytorch-e351c8d8@125.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape("mimi-pytorch-e351c8d8@125.safetensors")):
        MoshiEngine(1, weights=str(tmp_path))
    (tmp_path / "config.json").unlink()  # only the Moshi 7B repos ship none
    with pytest.raises(FileNotFoundError, match=r"config\.json.*--moshi-config"):
        MoshiEngine(1, weights=str(tmp_path))


def test_moshiko_without_config_takes_the_moshi_7b_defaults(tmp_path):
    folder = tmp_path / "moshiko-pytorch-bf16"
    folder.mkdir()
    moshiko = (
        "model.safetensors", "tokenizer-e351c8d8-checkpoint125.safetensors", "tokenizer_spm_32k_3.model",
    )
    for name in moshiko:
        (folder / name).touch()
    with warnings.catch_warnings():  # moshi's "Assuming this is a Moshi 7B": right here, so not said
        warnings.simplefilter("error")
        info = resolve_checkpoint(CheckpointSource(weights=str(folder)))
    assert info.lm_config is None and info.model_type == "moshi"
    assert info.moshi_weights == folder / "model.safetensors"


def cache_checkpoint(tmp_path: Path, tokenizer: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """tiny-hibiki as ``kyutai/hibiki-tiny-pytorch-bf16`` in a Hugging Face cache under
    ``tmp_path`` that huggingface_hub reads: its revision and its snapshot's folder."""
    from huggingface_hub import constants

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--kyutai--hibiki-tiny-pytorch-bf16"
    write_checkpoint(repo / "snapshots" / revision, "tiny-hibiki", tokenizer)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return revision, repo / "snapshots" / revision


def test_a_hugging_face_cache_resolves_offline(tmp_path, tokenizer, monkeypatch):
    revision, snapshot = cache_checkpoint(tmp_path, tokenizer, monkeypatch)
    for name in ("kyutai/hibiki-tiny-pytorch-bf16", f"kyutai/hibiki-tiny-pytorch-bf16@{revision}"):
        info = resolve_checkpoint(CheckpointSource(hf_repo=name))
        assert info.model_type == "hibiki" and info.lm_gen_config == get_preset("tiny-hibiki").lm_gen_config
        assert Path(info.moshi_weights) == snapshot / LM_NAME
        assert Path(info.tokenizer) == snapshot / "spm.model"
    (snapshot / LM_NAME).unlink()
    missing = f"{re.escape(LM_NAME)} of kyutai/hibiki-tiny.*not in the local"
    with pytest.raises(FileNotFoundError, match=missing):
        resolve_checkpoint(CheckpointSource(hf_repo="kyutai/hibiki-tiny-pytorch-bf16"))
    with pytest.raises(FileNotFoundError, match=r"config\.json of someone/absent@main is not in the local"):
        resolve_checkpoint(CheckpointSource(hf_repo="someone/absent"))


def test_sampling_comes_from_the_checkpoint_unless_given():
    gen = {"temp": 0.8, "temp_text": 0.4, "top_k": 250, "top_k_text": 25}
    assert Sampling().lm_gen_kwargs(gen) == {**gen, "use_sampling": True}
    assert Sampling(temp_text=0.9).lm_gen_kwargs(gen)["temp_text"] == 0.9
    assert Sampling(greedy=True).lm_gen_kwargs({}) == {"use_sampling": False}
    engine = MoshiEngine(2, "tiny-hibiki", threads=1)
    engine.start()
    try:
        assert (engine.lm_gen.temp_text, engine.lm_gen.temp) == (0.4, 0.8)
    finally:
        engine.stop()


def test_guidance_doubles_the_kv_in_the_memory_plan_and_needs_conditioning():
    from duplexserve.engine_bridge.moshi.memory import kv_bytes_per_slot

    one = kv_bytes_per_slot(24, 2560, 20, 500, "bf16", 2)
    assert kv_bytes_per_slot(24, 2560, 20, 500, "bf16", 2, branches=2) == 2 * one
    with pytest.raises(ValueError, match="no conditioning"):
        MoshiEngine(1, "tiny", cfg_coef=3.0)


def test_bench_mimi_compares_builds_on_a_cached_checkpoint_and_a_recording(tmp_path, tokenizer, monkeypatch):
    """``bench moshi-step mimi --hf-repo --audio``: the check an operator runs before turning on
    a Mimi option that is not the library's bit for bit (``tf32``, ``fused-cl``), on the released
    weights from the local cache and on speech, each session from its own point of the file."""
    import argparse

    import sphn

    from duplexserve.bench import moshi_step

    cache_checkpoint(tmp_path, tokenizer, monkeypatch)
    rate = 16000
    speech = (0.2 * np.sin(np.arange(rate) * 0.05) * np.linspace(0, 1, rate)).astype(np.float32)
    sphn.write_wav(str(tmp_path / "speech.wav"), speech[None], rate)

    audio = moshi_step._mimi_input(4, 3 * 1920, str(tmp_path / "speech.wav"))
    stored, _ = sphn.read(str(tmp_path / "speech.wav"))
    at_24k = sphn.resample(stored, src_sample_rate=rate, dst_sample_rate=24000)[0]
    quarter = len(at_24k) // 4
    assert audio.shape == (4, 3 * 1920) and quarter > 3 * 1920
    assert np.array_equal(audio[1], at_24k[quarter : quarter + 3 * 1920])

    parser = argparse.ArgumentParser()
    moshi_step.add_arguments(parser)
    args = ["mimi", "--hf-repo", "kyutai/hibiki-tiny-pytorch-bf16", "--audio", str(tmp_path / "speech.wav"),
            "--frames", "3", "--mimi-builds", "float32/whole/stock,float32/whole/fused"]  # fmt: skip
    [row] = moshi_step.cmd_mimi(parser.parse_args(args))
    assert row["preset"] == "kyutai/hibiki-tiny-pytorch-bf16" and row["audio"].endswith("speech.wav")
    assert row["identical_codes"] == 1.0 and row["identical_audio_samples"] == 1.0  # the CPU runs stock
    with pytest.raises(FileNotFoundError, match="not in the local"):
        moshi_step.cmd_mimi(parser.parse_args([*args[:1], "--hf-repo", "someone/absent", *args[3:]]))
