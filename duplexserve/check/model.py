"""Which model the moshi engine would serve with these options: one function resolves it.

A preset and a checkpoint (``--moshi-weights`` or ``--moshi-hf-repo``, with
``--moshi-config`` and ``--moshi-lora``) come down to the same ``Model``: the LM's and
Mimi's kwargs as moshi's loaders take them, the family and the codebooks per stream.
``resolve_model`` is the one place ``duplexserve check`` and the serve preflight ask, so
a new source of models is one more branch there. A preset is read from
``presets.py`` (no torch); a checkpoint through the engine's own ``resolve_checkpoint``,
which reads its config.json with moshi's loaders, as the engine will (torch and moshi
imported, no weights loaded, nothing downloaded).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from duplexserve.check.requirements import Problem
from duplexserve.config import ServerConfig
from duplexserve.engine_bridge.moshi.checkpoint import CheckpointSource, resolve_checkpoint
from duplexserve.engine_bridge.moshi.presets import MOSHI_7B_LM, get_preset, stream_codebooks

WEIGHTS_FIX = "point --moshi-weights at a folder laid out like the checkpoint's Hugging Face repository"
SETTINGS_FIX = "docs/moshi-engine.md (Weights) says what a checkpoint needs and which settings go together"
FETCH = ("fetch it into the cache once (--moshi-hf-repo and check never download; "
         "`duplexserve serve OWNER/NAME` does): huggingface-cli download")


@dataclass(frozen=True)
class Model:
    source: str  # what the options chose, in words
    lm: dict[str, Any]  # LMModel's kwargs, --moshi-context applied
    mimi: dict[str, Any] | None  # Mimi's config; None: moshi's stock Mimi
    model_type: str
    codebooks: int  # Mimi codebooks per stream
    tokenizer: bool  # a SentencePiece model: the checkpoint's, --moshi-tokenizer's or the preset's toy

    def describe(self) -> str:
        lm = self.lm
        heads, repeat = lm["num_heads"], lm.get("kv_repeat", 1)
        kv_heads = f" ({heads // repeat} KV heads)" if repeat > 1 else ""
        return (
            f"{self.source}: {self.model_type} LM {lm['num_layers']} layers, d={lm['dim']}, {heads} heads"
            f"{kv_heads}, context {lm['context']} frames, delay {max(lm['delays'])}; Mimi {self.codebooks} "
            "codebooks a stream"
        )


class ModelError(Exception):
    """The options name a model that cannot be served; ``problem`` says why and what to do."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.line())
        self.problem = problem


def checkpoint_named(config: ServerConfig) -> bool:
    """Whether the options name a checkpoint (resolving it imports moshi) rather than a preset."""
    return CheckpointSource.from_config(config).given


def resolve_model(config: ServerConfig) -> Model:
    """The model of ``config``: its checkpoint if one is named, else ``--moshi-preset``; raises ModelError."""
    source = CheckpointSource.from_config(config)
    if source.given:
        try:
            info = resolve_checkpoint(source)
        except FileNotFoundError as exc:
            repo, _, revision = source.hf_repo.partition("@")
            fix = f"{FETCH} {repo}" + (f" --revision {revision}" if revision else "") if repo else WEIGHTS_FIX
            raise ModelError(Problem(str(exc), fix)) from exc
        except (OSError, ValueError, KeyError) as exc:  # a bad config, LoRA without its config, ...
            raise ModelError(Problem(str(exc), SETTINGS_FIX)) from exc
        lm = dict(info.lm_config or MOSHI_7B_LM)  # no config.json: moshi's Moshi 7B
        streams = 2 if info.tts_config.get("multistream") else 1  # as CheckpointInfo.get_mimi counts
        codebooks = stream_codebooks(lm) // streams
        given = [("config", source.config), ("LoRA", source.lora)]
        name = f"{source.hf_repo or Path(source.weights).resolve()}" + "".join(
            f", {what} {path}" for what, path in given if path
        )
        described, mimi, model_type = f"checkpoint {name}", info.mimi_config, info.model_type
        tokenizer = bool(info.tokenizer)
    else:
        for flag, path in (("--moshi-config", config.moshi_config), ("--moshi-lora", config.moshi_lora)):
            if path:  # a preset's random weights would take neither, without a word
                what = f"{flag} {path} applies to a checkpoint, and none is named (preset " \
                       f"{config.moshi_preset})"
                fix = f"name the checkpoint (--moshi-weights DIR, --moshi-hf-repo OWNER/NAME), or leave " \
                      f"{flag} out"
                raise ModelError(Problem(what, fix))
        tokenizer = bool(config.moshi_tokenizer)
        if tokenizer and not Path(config.moshi_tokenizer).is_file():
            fix = "point it at a SentencePiece model, or leave it out (no text)"
            raise ModelError(Problem(f"--moshi-tokenizer {config.moshi_tokenizer} is not a file", fix))
        try:
            preset = get_preset(config.moshi_preset)
        except ValueError as exc:
            fix = "use one of those, or name a checkpoint (--moshi-weights DIR, --moshi-hf-repo OWNER/NAME)"
            raise ModelError(Problem(str(exc), fix)) from None
        lm, mimi, model_type, codebooks = dict(preset.lm), preset.mimi, preset.model_type, preset.codebooks
        toy = " and a toy tokenizer" if preset.tokenizer and not tokenizer else ""
        described = f"preset {preset.name} (random weights{toy})"
        tokenizer = tokenizer or bool(preset.tokenizer)
    if config.moshi_context:
        lm["context"] = config.moshi_context
    return Model(described, lm, mimi, model_type, codebooks, tokenizer)
