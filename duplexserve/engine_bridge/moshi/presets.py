"""Architecture presets for the moshi engine, and the resolution of local weight folders.

A preset is the real architecture (Mimi codec + multistream LM) with random weights,
so the serving path can be measured on the true shapes without any download:

- ``moshi-7b``: Kyutai's Moshi 7B as ``moshi.models.loaders`` defines it (32 layers,
  d=4096, 8 codebooks per stream, context 3000 steps).
- ``hibiki-2b``: the 2B class of Hibiki (24 layers, d=2048, 16 codebooks per stream,
  48k text vocabulary, acoustic delay 2), the shape BENCHMARKS.md's anchors were
  measured on.
- ``tiny``: both models shrunk until a CPU step of a few sessions costs milliseconds
  (a stock Mimi alone costs seconds per step on a CPU): for tests.

This module imports neither torch nor moshi, so the server can describe a preset
before the engine thread loads anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The constants below restate moshi.models.loaders (0.2.13: _seanet_kwargs,
# _transformer_kwargs, _lm_kwargs) so that this module stays importable without moshi.
SEANET: dict[str, Any] = {
    "channels": 1,
    "dimension": 512,
    "causal": True,
    "n_filters": 64,
    "n_residual_layers": 1,
    "activation": "ELU",
    "compress": 2,
    "dilation_base": 2,
    "disable_norm_outer_blocks": 0,
    "kernel_size": 7,
    "residual_kernel_size": 3,
    "last_kernel_size": 3,
    "norm": "none",
    "pad_mode": "constant",
    "ratios": [8, 6, 5, 4],  # hop 960 at 24 kHz: 25 Hz, downsampled x2 to 12.5 Hz
    "true_skip": True,
}
MIMI_TRANSFORMER: dict[str, Any] = {
    "d_model": 512,
    "num_heads": 8,
    "num_layers": 8,
    "causal": True,
    "layer_scale": 0.01,
    "context": 250,
    "conv_layout": True,
    "max_period": 10000,
    "gating": "none",
    "norm": "layer_norm",
    "positional_embedding": "rope",
    "dim_feedforward": 2048,
    "input_dimension": 512,
    "output_dimensions": [512],
}
MIMI: dict[str, Any] = {
    "sample_rate": 24000,
    "channels": 1,
    "frame_rate": 12.5,
    "seanet": SEANET,
    "quantizer": {"dimension": 256, "n_q": 32, "bins": 2048, "input_dimension": 512, "output_dimension": 512},
    "transformer": MIMI_TRANSFORMER,
}
MOSHI_7B_LM: dict[str, Any] = {
    "dim": 4096,
    "text_card": 32000,
    "existing_text_padding_id": 3,
    "n_q": 16,
    "dep_q": 8,
    "card": 2048,
    "num_heads": 32,
    "num_layers": 32,
    "hidden_scale": 4.125,
    "causal": True,
    "layer_scale": None,
    "context": 3000,
    "max_period": 10000,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_dim": 1024,
    "depformer_dim_feedforward": int(4.125 * 1024),
    "depformer_num_heads": 16,
    "depformer_num_layers": 6,
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_context": 8,
    "depformer_max_period": 10000,
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "delays": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
}


def _delays(codebooks: int, acoustic_delay: int) -> list[int]:
    """Text stream, then per audio stream a semantic codebook (0) and delayed acoustic ones."""
    stream = [0] + [acoustic_delay] * (codebooks - 1)
    return [0, *stream, *stream]


HIBIKI_2B_LM: dict[str, Any] = {
    **MOSHI_7B_LM,
    "dim": 2048,
    "num_heads": 16,
    "num_layers": 24,
    "text_card": 48000,
    "n_q": 32,
    "dep_q": 16,
    "delays": _delays(16, 2),
}

TINY_MIMI: dict[str, Any] = {
    **MIMI,
    "seanet": {**SEANET, "n_filters": 4, "dimension": 32},
    "quantizer": {"dimension": 16, "n_q": 8, "bins": 64, "input_dimension": 32, "output_dimension": 32},
    "transformer": {
        **MIMI_TRANSFORMER,
        "d_model": 32,
        "num_heads": 2,
        "num_layers": 1,
        "dim_feedforward": 64,
        "input_dimension": 32,
        "output_dimensions": [32],
        "context": 50,
    },
}
TINY_LM: dict[str, Any] = {
    **MOSHI_7B_LM,
    "dim": 64,
    "text_card": 64,
    "n_q": 8,
    "dep_q": 4,
    "card": 64,
    "num_heads": 4,
    "num_layers": 2,
    "context": 200,
    "depformer_dim": 32,
    "depformer_dim_feedforward": 64,
    "depformer_num_heads": 2,
    "depformer_num_layers": 1,
    "delays": _delays(4, 1),
}


@dataclass(frozen=True)
class Preset:
    name: str
    lm: dict[str, Any]
    mimi: dict[str, Any]
    codebooks: int  # Mimi codebooks per stream (user in, model out)

    @property
    def max_delay(self) -> int:
        """Frames between an input frame and the model's first answer to it (LMGen's delay)."""
        return max(self.lm["delays"])


PRESETS: dict[str, Preset] = {
    "moshi-7b": Preset("moshi-7b", MOSHI_7B_LM, MIMI, 8),
    "hibiki-2b": Preset("hibiki-2b", HIBIKI_2B_LM, MIMI, 16),
    "tiny": Preset("tiny", TINY_LM, TINY_MIMI, 4),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown moshi preset {name!r}; known: {', '.join(PRESETS)}") from None


@dataclass(frozen=True)
class LocalWeights:
    """Paths of one model in a local folder laid out like Kyutai's Hugging Face repos."""

    lm: Path
    mimi: Path
    tokenizer: Path | None
    lm_config: dict[str, Any] | None  # None: the Moshi 7B architecture
    mimi_config: dict[str, Any] | None  # None: the stock Mimi
    model_type: str = "moshi"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def codebooks(self) -> int:
        cfg = self.lm_config or MOSHI_7B_LM
        return max(cfg["dep_q"], cfg["n_q"] - cfg["dep_q"])


def resolve_weights(folder: str | Path, tokenizer: str | Path | None = None) -> LocalWeights:
    """Find the LM, Mimi and tokenizer files in ``folder``; never downloads.

    ``config.json``, when present, is Kyutai's: the LM's kwargs plus ``moshi_name``,
    ``mimi_name``, ``tokenizer_name``, ``mimi_config_name`` and ``model_type``. Without
    it the folder must hold a Moshi 7B (``model.safetensors`` and the stock Mimi).
    """
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"moshi weights folder {root} does not exist")
    config_path = root / "config.json"
    lm_config: dict[str, Any] | None = None
    names = {
        "moshi_name": "model.safetensors",
        "mimi_name": "tokenizer-e351c8d8-checkpoint125.safetensors",
        "tokenizer_name": "tokenizer_spm_32k_3.model",
    }
    model_type = "moshi"
    mimi_config: dict[str, Any] | None = None
    extra: dict[str, Any] = {}
    if config_path.exists():
        lm_config = json.loads(config_path.read_text())
        for key in names:
            names[key] = lm_config.pop(key, names[key])
        model_type = lm_config.pop("model_type", "moshi")
        mimi_config_name = lm_config.pop("mimi_config_name", None)
        if mimi_config_name:
            mimi_config = json.loads((root / mimi_config_name).read_text())
        for key in ("lm_gen_config", "tts_config", "stt_config", "model_id", "lora_name"):
            if key in lm_config:
                extra[key] = lm_config.pop(key)
        if extra.get("lora_name"):
            raise ValueError("LoRA checkpoints are not supported by the moshi engine")
    lm = root / names["moshi_name"]
    mimi = root / names["mimi_name"]
    for path in (lm, mimi):
        if not path.exists():
            raise FileNotFoundError(f"moshi weights: {path} not found")
    if tokenizer:
        tok = Path(tokenizer)
        if not tok.exists():
            raise FileNotFoundError(f"moshi tokenizer {tok} not found")
    else:
        tok = root / names["tokenizer_name"]
    return LocalWeights(lm, mimi, tok if tok.exists() else None, lm_config, mimi_config, model_type, extra)
