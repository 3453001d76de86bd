"""Architecture presets for the moshi engine: released checkpoints' shapes with random weights.

A preset is the architecture of a released checkpoint (Mimi codec + multistream LM, its
``model_type`` and ``lm_gen_config``) with random weights, so the serving path can be
measured on the true shapes without any download, and the tiny ones give the CPU tests
every feature the released configs use. Beside each config, how sure its values are:
[V] read verbatim from a published file (the MLX or Rust twin of the checkpoint, or
moshi's own code), [R] reconstructed from ports and reports, with the confidence.

- ``moshi-7b``: ``kyutai/moshiko|moshika-pytorch-bf16`` (moshi's own ``_lm_kwargs``).
- ``hibiki-1b``, ``hibiki-2b``: ``kyutai/hibiki-{1b,2b}-pytorch-bf16`` (FR->EN).
- ``hibiki-zero-3b``: ``kyutai/hibiki-zero-3b-pytorch-bf16`` (reconstructed).
- ``personaplex-7b``: ``nvidia/personaplex-7b-v1``, whose config.json names only its
  ``model_type``: the architecture is NVIDIA's loader's (Moshi 7B with 16 depformer steps).
- ``hibiki-2b-class``: the 2B class of Hibiki (24 layers, d=2048) that docs/benchmarks.md's
  H200 numbers were measured on, before the released 2B's shape was known.
- ``tiny`` and ``tiny-*``: shrunk until a CPU step of a few sessions costs milliseconds (a
  stock Mimi alone costs seconds per step on a CPU): for tests, one per released feature,
  and with the project's toy tokenizer (toy_tokenizer.py) for text prompts and text output.

This module imports neither torch nor moshi, so the server can describe a preset
before the engine thread loads anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from duplexserve.engine_bridge.moshi.toy_tokenizer import TOY_TOKENIZER

if TYPE_CHECKING:
    from duplexserve.config import ServerConfig

TOY = str(TOY_TOKENIZER)  # the tiny presets' tokenizer, a toy like their weights (toy_tokenizer.py)

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


def stream_codebooks(lm: dict[str, Any]) -> int:
    """Mimi codebooks per stream. moshi's CheckpointInfo counts ``max(dep_q, n_q - dep_q)``,
    which is 16 for a depformer that also predicts the user's stream (PersonaPlex: n_q 16,
    dep_q 16), whose streams are 8 codebooks each."""
    if lm["dep_q"] == lm["n_q"]:
        return lm["n_q"] // 2
    return max(lm["dep_q"], lm["n_q"] - lm["dep_q"])


def _delays(codebooks: int, acoustic_delay: int) -> list[int]:
    """Text stream, then per audio stream a semantic codebook (0) and delayed acoustic ones."""
    stream = [0] + [acoustic_delay] * (codebooks - 1)
    return [0, *stream, *stream]


# Hibiki's description conditioner, summed into the input at every step; the server asks
# for "very_good" (and "very_bad" as the negative with --moshi-cfg-coef): [V] in the 1B and
# 2B MLX configs, the fuser [R high] for the 2B.
HIBIKI_CONDITIONING: dict[str, Any] = {
    "conditioners": {
        "description": {
            "type": "lut",
            "lut": {
                "n_bins": 31,
                "dim": 16,
                "tokenizer": "noop",
                "possible_values": ["very_bad", "bad", "neutral", "good", "very_good"],
            },
        }
    },
    "fuser": {"sum": ["description"]},
}
HIBIKI_GEN: dict[str, Any] = {"temp": 0.8, "temp_text": 0.4, "top_k": 250, "top_k_text": 25}  # [R medium]
SCHEDULE_16: list[int] = [*range(9), *[8] * 7]  # 16 depformer steps, 9 sets of weights

HIBIKI_1B_LM: dict[str, Any] = {  # the MLX twin's config [V], pytorch-only keys [R medium]
    **MOSHI_7B_LM,
    **HIBIKI_CONDITIONING,
    "dim": 2048,
    "num_heads": 16,
    "num_layers": 16,
    "text_card": 48000,
    "context": 1500,  # [R medium] the pytorch parent's, per a derived student; the MLX twin says 500
    "max_period": 100000,
    "depformer_context": 16,
    "delays": _delays(8, 2),
}
HIBIKI_2B_LM: dict[str, Any] = {  # the MLX twin's config [V] up to the conditioners; fuser [R high]
    **MOSHI_7B_LM,
    **HIBIKI_CONDITIONING,
    "dim": 2560,
    "num_heads": 20,
    "num_layers": 24,
    "text_card": 48000,
    "n_q": 32,
    "dep_q": 16,
    "context": 500,
    "max_period": 100000,
    "depformer_dim_feedforward": 3072,
    "depformer_num_layers": 4,
    "depformer_context": 16,
    "depformer_weights_per_step_schedule": SCHEDULE_16,
    "depformer_low_rank_embeddings": 128,
    "delays": _delays(16, 2),
}
HIBIKI_ZERO_3B_LM: dict[str, Any] = {  # [R]: architecture medium-high, key spellings medium
    **MOSHI_7B_LM,
    "dim": 2048,
    "num_heads": 16,
    "num_layers": 28,
    "kv_repeat": 2,  # 8 KV heads; moshi gives the depformer the same unless depformer_kv_repeat says
    "hidden_scale": 6.0,
    "max_period": 20000,
    "positional_embedding": "rope_concat",
    "text_card": 48000,
    "n_q": 32,
    "dep_q": 16,
    "depformer_dim_feedforward": None,  # 6.0 x 1024
    "depformer_context": 16,
    "depformer_weights_per_step_schedule": SCHEDULE_16,
    "depformer_norm": "layer_norm",  # [R] learned per-step output norms
    "delays": _delays(16, 2),
}  # no conditioners: unknown for the release (a checkpoint's own config decides)
# NVIDIA's loader: moshi's _lm_kwargs with dep_q 16 [V]; the depformer also predicts the
# user's 8 codebooks (steps 8-15), whose tokens are always replaced by the user's own.
PERSONAPLEX_7B_LM: dict[str, Any] = {**MOSHI_7B_LM, "dep_q": 16}
PERSONAPLEX_GEN: dict[str, Any] = {"temp": 0.8, "temp_text": 0.7, "top_k": 250, "top_k_text": 25}  # [V]
HIBIKI_2B_CLASS_LM: dict[str, Any] = {
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
TINY_MIMI_16: dict[str, Any] = {**TINY_MIMI, "quantizer": {**TINY_MIMI["quantizer"], "n_q": 16}}
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
TINY_HIBIKI_LM: dict[str, Any] = {  # hibiki-2b's features: conditioning, schedule, low rank, 16 steps
    **TINY_LM,
    **HIBIKI_CONDITIONING,
    "n_q": 32,
    "dep_q": 16,
    "max_period": 100000,
    "depformer_context": 16,
    "depformer_weights_per_step_schedule": SCHEDULE_16,
    "depformer_low_rank_embeddings": 8,
    "delays": _delays(16, 2),
}
TINY_ZERO_LM: dict[str, Any] = {  # hibiki-zero-3b's: grouped KV heads, rope_concat, depformer norms
    **TINY_HIBIKI_LM,
    "kv_repeat": 2,
    "hidden_scale": 6.0,
    "positional_embedding": "rope_concat",
    "depformer_dim_feedforward": None,
    "depformer_norm": "layer_norm",
    "depformer_low_rank_embeddings": None,
}
# personaplex-7b's: the depformer predicts both streams (dep_q == n_q: 4 + 4 codebooks here)
TINY_PERSONAPLEX_LM: dict[str, Any] = {**TINY_LM, "dep_q": 8}


@dataclass(frozen=True)
class Preset:
    name: str
    lm: dict[str, Any]  # LMModel's kwargs, as a checkpoint's config.json holds them
    mimi: dict[str, Any]
    model_type: str = "moshi"  # what differs per session (families.py)
    lm_gen_config: dict[str, Any] = field(default_factory=dict)  # the checkpoint's sampling defaults
    tokenizer: str = ""  # its SentencePiece model (the tiny ones': the toy); empty: none, no text

    @property
    def codebooks(self) -> int:
        """Mimi codebooks per stream (user in, model out)."""
        return stream_codebooks(self.lm)

    @property
    def max_delay(self) -> int:
        """Frames between an input frame and the model's first answer to it (LMGen's delay)."""
        return max(self.lm["delays"])


PRESETS: dict[str, Preset] = {
    "moshi-7b": Preset("moshi-7b", MOSHI_7B_LM, MIMI),
    "hibiki-1b": Preset("hibiki-1b", HIBIKI_1B_LM, MIMI, "hibiki", HIBIKI_GEN),
    "hibiki-2b": Preset("hibiki-2b", HIBIKI_2B_LM, MIMI, "hibiki", HIBIKI_GEN),
    "hibiki-zero-3b": Preset("hibiki-zero-3b", HIBIKI_ZERO_3B_LM, MIMI, "hibiki", HIBIKI_GEN),
    "personaplex-7b": Preset("personaplex-7b", PERSONAPLEX_7B_LM, MIMI, "personaplex", PERSONAPLEX_GEN),
    "hibiki-2b-class": Preset("hibiki-2b-class", HIBIKI_2B_CLASS_LM, MIMI),
    "tiny": Preset("tiny", TINY_LM, TINY_MIMI, tokenizer=TOY),
    "tiny-hibiki": Preset("tiny-hibiki", TINY_HIBIKI_LM, TINY_MIMI_16, "hibiki", HIBIKI_GEN, TOY),
    "tiny-zero": Preset("tiny-zero", TINY_ZERO_LM, TINY_MIMI_16, "hibiki", HIBIKI_GEN, TOY),
    "tiny-personaplex": Preset(
        "tiny-personaplex", TINY_PERSONAPLEX_LM, TINY_MIMI, "personaplex", PERSONAPLEX_GEN, TOY
    ),
}


def served_tokenizer(config: ServerConfig) -> str:
    """The SentencePiece model the moshi engine is given: ``--moshi-tokenizer``, else where no
    checkpoint is named (whose own the engine reads) the preset's; empty: none."""
    if config.moshi_tokenizer or config.moshi_hf_repo or config.moshi_weights:
        return config.moshi_tokenizer
    preset = PRESETS.get(config.moshi_preset)
    return preset.tokenizer if preset else ""


def preset_note() -> str:
    """The presets, for ``--moshi-preset``'s help (config.py may not import this module)."""
    return f"one of {', '.join(PRESETS)}"


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown moshi preset {name!r}; known: {', '.join(PRESETS)}") from None
