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
