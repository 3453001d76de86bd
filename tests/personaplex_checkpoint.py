"""A tiny PersonaPlex checkpoint in NVIDIA's released layout, shared by the engine and server tests.

Its stub config.json, ``model.safetensors`` with every one of the depformer's steps, the
Mimi and SentencePiece files under NVIDIA's names (the ``tiny-personaplex`` preset
supplies the architecture the stub leaves out), and ``voices/`` with a voice of each
kind: a ``.wav``, and the ``.pt`` NVIDIA's server saves from it. Random weights.
conftest.py builds it once a test session (``personaplex_checkpoint``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.test_moshi_engine import _tokenizer
from tests.test_moshi_equivalence import signal

PRESET = "tiny-personaplex"
CONTEXT = 64  # the LM context of the references and the servers under test, in frames


def build_checkpoint(folder: Path) -> Path:
    """The released layout, random weights, and the voices folder beside it, in ``folder``."""
    import torch
    from safetensors.torch import save_file

    from duplexserve.engine_bridge.moshi.checkpoint import preset_checkpoint
    from duplexserve.engine_bridge.moshi.engine import _calibrate_codebooks
    from duplexserve.engine_bridge.moshi.presets import get_preset
    from duplexserve.engine_bridge.moshi.reference import personaplex_loop

    preset = get_preset(PRESET)
    torch.manual_seed(11)
    info = preset_checkpoint(preset)
    mimi = info.get_mimi()
    _calibrate_codebooks(mimi)
    lm = info.get_moshi(dtype=torch.float32, load_weight=False)
    assert lm.dep_q == lm.n_q  # every step of the depformer is in the file
    save_file(lm.state_dict(), str(folder / "model.safetensors"))
    save_file(mimi.state_dict(), str(folder / "tokenizer-e351c8d8-checkpoint125.safetensors"))
    _tokenizer(folder / "tokenizer_spm_32k_3.model")
    (folder / "config.json").write_text(json.dumps({"model_type": "personaplex", "version": "7b-v1"}))
    voices = folder / "voices"
    voices.mkdir()
    write_wav(voices / "voice.wav", 0.5 * signal(99, 5).reshape(-1))
    _, _, saved = personaplex_loop(
        reference(folder), np.zeros((0, 1920), np.float32), layout(folder), voice=wav_voice(folder)
    )
    torch.save({"embeddings": saved["embeddings"].float(), "cache": saved["cache"]}, voices / "voice.pt")
    return folder


def write_wav(path: Path, pcm: np.ndarray, rate: int = 24000) -> None:
    import wave

    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes())


def reference(folder: Path) -> tuple:
    """The checkpoint as NVIDIA's loader builds it: every depformer step, float64."""
    import torch

    from duplexserve.engine_bridge.moshi.checkpoint import CheckpointSource, resolve_checkpoint

    info = resolve_checkpoint(CheckpointSource(weights=str(folder), preset=PRESET))
    mimi = info.get_mimi().double()
    mimi.set_num_codebooks(4)
    lm = info.get_moshi(dtype=torch.float64, lm_kwargs_overrides={"context": CONTEXT})
    return mimi, lm, info.model_type


def layout(folder: Path):
    from duplexserve.engine_bridge.moshi.prompts import StreamLayout

    mimi, lm, _ = reference(folder)
    return StreamLayout.of(lm, mimi)


def wav_voice(folder: Path):
    from duplexserve.engine_bridge.moshi.prompts import load_voice

    mimi, lm, _ = reference(folder)
    return load_voice(folder / "voices" / "voice.wav", mimi, lm.dim, lm.num_codebooks)
