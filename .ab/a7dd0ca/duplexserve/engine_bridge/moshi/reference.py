"""Kyutai's own serving loop at batch 1: what every session of the batched engine must equal.

``server_loop`` is ``moshi.server``'s per-session loop on stock modules: one
``streaming(1)`` state, the family's condition tensors (moshi's
``get_condition_tensors``), Mimi reset after the first frame is encoded, ``LMGen.step``
returning None during the model's delay, ``mimi.decode(tokens[:, 1:])`` otherwise. The
equivalence tests (float64, exact) and ``bench moshi-step agreement`` (the GPU, bf16)
compare the engine with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

FRAME = 1920


@contextlib.contextmanager
def lm_tokens(engine: Any) -> Iterator[list[Any]]:
    """The tokens of every ``LMGen.step`` the engine runs meanwhile, in the batch's row order
    (``engine.rows_of`` maps slots to rows): what the engine's answers are compared by."""
    captured: list[Any] = []
    step = engine.lm_gen.step
    engine.lm_gen.step = lambda codes: captured.append(step(codes)) or captured[-1]
    try:
        yield captured
    finally:
        engine.lm_gen.step = step


def stock_models(engine: Any, context: int = 0) -> tuple[Any, Any, str]:
    """Stock Mimi and LM of the engine's preset holding the engine's weights, its model_type."""
    from duplexserve.engine_bridge.moshi.checkpoint import preset_checkpoint

    info = preset_checkpoint(engine.preset)
    lm_model = engine.lm_gen.lm_model
    mimi = info.get_mimi(device=engine.device).to(next(engine.mimi.parameters()).dtype)
    overrides = {"context": context} if context else {}
    lm = info.get_moshi(
        device=engine.device, dtype=lm_model.dtype, load_weight=False, lm_kwargs_overrides=overrides
    )
    mimi.load_state_dict(engine.mimi.state_dict())
    lm.load_state_dict(lm_model.state_dict())
    return mimi, lm, info.model_type


def server_loop(
    models: tuple[Any, Any, str], frames: np.ndarray, cfg_coef: float = 1.0, end_of_input: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """moshi.server's loop, greedy, over ``frames`` on ``(mimi, lm, model_type)``: the audio
    (silence while LMGen returns None) and the tokens of every frame it answers.

    With ``end_of_input``, frame ``end_of_input`` is not encoded: its codes are ``card`` on
    every codebook, as moshi's run_inference tells Hibiki that its input ended."""
    import torch
    from moshi.models import LMGen
    from moshi.run_inference import get_condition_tensors

    mimi, lm, model_type = models
    conditions = get_condition_tensors(model_type, lm, 1, cfg_coef)
    lm_gen = LMGen(lm, use_sampling=False, cfg_coef=cfg_coef, condition_tensors=conditions)
    dtype = next(mimi.parameters()).dtype
    audio, tokens = [], []
    with torch.no_grad(), mimi.streaming(1), lm_gen.streaming(1):
        for i, frame in enumerate(frames):
            if i == end_of_input:
                codes = torch.full((1, mimi.num_codebooks, 1), mimi.cardinality, device=lm.device)
            else:
                codes = mimi.encode(torch.from_numpy(frame).to(lm.device, dtype).view(1, 1, -1))
            if i == 0:
                mimi.reset_streaming()  # the server's first-frame rule
            out = lm_gen.step(codes)
            if out is None:
                audio.append(np.zeros(FRAME, np.float32))
            else:
                tokens.append(out[0, :, 0].cpu().numpy())
                audio.append(mimi.decode(out[:, 1:])[0, 0].float().cpu().numpy())
    return np.stack(audio), np.stack(tokens)


def personaplex_loop(
    models: tuple[Any, Any, str],
    frames: np.ndarray,
    layout: Any,
    text: list[int] | tuple[int, ...] = (),
    voice: Any = None,
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """NVIDIA's PersonaPlex server loop, greedy, on ``(mimi, lm, _)`` with all 16 of its
    depformer steps: the prompt stepped frame by frame with every stream forced (the
    voice: a ``prompts.Voice`` of codes, or of embeddings and a cache), then ``frames``.

    NVIDIA's ``LMGen`` as its source has it: a token cache of ``max_delay + 3`` with a
    "provided" flag per entry; call 0 runs no model; call ``o`` writes the given tokens
    at ``o + delay``, runs the model on position ``o - 1`` and forces position ``o``
    where given (inside the depformer too: a provided token replaces the sampled one as
    the next step's input). Returns the audio and the tokens (text and the agent's
    codebooks) of every conversation frame, and the voice as NVIDIA saves a ``.pt``
    (``embeddings`` of each model call's input during the voice, the ``cache`` after it).
    """
    import torch

    from duplexserve.engine_bridge.moshi.prompts import SILENCE_FRAMES, TEXT_PAD

    mimi, lm, _ = models
    streams, delays, agent = lm.num_codebooks, list(lm.delays), lm.n_q // 2
    depth, ring = max(delays), max(delays) + 3
    device = next(lm.parameters()).device
    cache = torch.full((streams, ring), lm.ungenerated_token_id, dtype=torch.long, device=device)
    provided = torch.zeros((streams, ring), dtype=torch.bool, device=device)
    initial = lm._get_initial_token().view(-1).to(device)
    offset = 0
    saved: list[Any] = []

    def write(stream: int, token: int) -> None:
        at = (offset + delays[stream]) % ring
        cache[stream, at], provided[stream, at] = token, True

    def call(user: Any, agent_codes: Any = None, text_token: int | None = None, embedding: Any = None) -> Any:
        nonlocal offset
        for i, token in enumerate(user):
            write(1 + agent + i, int(token))
        if agent_codes is not None:
            for i, token in enumerate(agent_codes):
                write(1 + i, int(token))
        if text_token is not None:
            write(0, text_token)
        for k, d in enumerate(delays):
            if offset <= d:
                cache[k, offset % ring], provided[k, offset % ring] = initial[k], True
        if offset == 0:
            cache[:, 0] = initial
            offset += 1
            return None
        source, target = (offset - 1) % ring, offset % ring
        if embedding is None:
            sequence = cache[None, :, source : source + 1]
            audio_sum = sum(lm.emb[k](sequence[:, k + 1]) for k in range(lm.n_q))
            saved.append(audio_sum + lm.text_emb(sequence[:, 0]))  # NVIDIA's embed_codes, in its order
            out, text_logits = lm.forward_text(sequence)
        else:
            out = lm.transformer(embedding.to(device, lm.dtype).view(1, 1, -1))
            out = lm.out_norm(out) if lm.out_norm else out
            text_logits = lm.text_linear(out)[:, None]
        sampled = [int(text_logits[0, 0, 0].argmax())]
        previous = int(cache[0, target]) if provided[0, target] else sampled[0]
        with lm.depformer.streaming(1):
            for cb in range(lm.dep_q):
                logits = lm.forward_depformer(cb, torch.tensor([[[previous]]], device=device), out)
                sampled.append(int(logits[0, 0, 0].argmax()))
                previous = int(cache[1 + cb, target]) if provided[1 + cb, target] else sampled[-1]
        provided[:, source] = False
        for k, token in enumerate(sampled):
            if not provided[k, target]:
                cache[k, target] = token
        offset += 1
        if offset - 1 <= depth:
            return None
        positions = [(offset - 1 - depth + d) % ring for d in delays[: lm.dep_q + 1]]
        return cache[torch.arange(lm.dep_q + 1, device=device), torch.tensor(positions, device=device)]

    sine, silence = layout.sine, layout.silence
    dtype = next(mimi.parameters()).dtype
    audio, tokens = [], []
    embeddings = None
    with torch.no_grad(), mimi.streaming(1), lm.streaming(1):
        if voice is not None and voice.codes is not None:
            saved.clear()
            for codes in voice.codes:
                call(sine, codes, TEXT_PAD)
            embeddings = torch.stack(saved).detach().clone()  # [calls - 1, 1, 1, dim], as NVIDIA saves
        elif voice is not None:  # step_embeddings: dummy tokens (the initial ones) given, then the cache
            dummy = initial[1 : 1 + agent].tolist()
            call(dummy, dummy, TEXT_PAD)  # call 0 runs no model
            for embedding in voice.embeddings:
                call(dummy, dummy, TEXT_PAD, embedding)
            cache.copy_(voice.cache.to(device))
        voice_cache = cache.clone()
        for token in [TEXT_PAD] * SILENCE_FRAMES + list(text) + [TEXT_PAD] * SILENCE_FRAMES:
            call(sine, silence, token)
        for frame in frames:
            codes = mimi.encode(torch.from_numpy(frame).to(device, dtype).view(1, 1, -1))
            out = call(codes[0, :, 0].tolist())
            tokens.append(out[: 1 + agent].cpu().numpy())
            audio.append(mimi.decode(out[None, 1 : 1 + agent, None])[0, 0].float().cpu().numpy())
    audio_out = np.stack(audio) if audio else np.zeros((0, FRAME), np.float32)
    tokens_out = np.stack(tokens) if tokens else np.zeros((0, 1 + agent), np.int64)
    return audio_out, tokens_out, {"embeddings": embeddings, "cache": voice_cache[None]}
