"""A reused slot starts from exactly a fresh engine's slot, for every model family.

Two engines of the same preset and seed: one fresh, one whose only slot served other
sessions first (other input, other prompts, the prompt cache on or off). The same session
in both must leave every per-row tensor of slot_state.py equal, step after step, and
answer the same audio and text tokens. Engine-level: tests/test_persona_isolation.py
checks the same through the server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.test_moshi_equivalence import signal

pytest.importorskip("moshi")

from duplexserve.engine_bridge.moshi.engine import MoshiEngine, Sampling

CONTEXT = 64
PROMPT = {"text_prompt": "hello duplex"}
OTHER = {"text_prompt": "You are a wise teacher."}


def engine_of(
    preset: str, checkpoint: Path | None = None, cache_mb: int = 1024, cfg: float = 1.0
) -> MoshiEngine:
    """One slot of ``preset`` (with ``checkpoint``'s weights, tokenizer and voices)."""
    engine = MoshiEngine(
        1, preset, weights=str(checkpoint or ""), context=CONTEXT, sampling=Sampling(greedy=True),
        threads=1, dtype="float64", voice_dir=str(checkpoint / "voices") if checkpoint else "",
        prompt_cache_mb=cache_mb, cfg_coef=cfg,
    )  # fmt: skip
    engine.start()
    return engine


def session(engine: MoshiEngine, frames: np.ndarray, params: dict[str, Any] | None) -> list[Any]:
    """One session in slot 0: open, its prompt (prompted families), its frames. After each step
    the row's state (every per-row tensor but rings' data) and the step's answer."""
    engine.open(0, params or {})
    if params is not None:
        engine.prompt(0, params)
    trace = []
    for frame in frames:
        result = engine.step(np.array([0]), frame[None])
        slots = engine._slots
        rows = [e.by_copy(slots.rows).narrow(e.axis + 1, 0, 1) for e in slots.entries if e.fresh is not None]
        state = [r.clone() for r in rows]
        trace.append((state, result.audio.copy(), engine._text_np[:1].copy()))
    engine.close(0)
    return trace


def assert_same(got: list[Any], want: list[Any]) -> None:
    for step, ((state, audio, text), (state0, audio0, text0)) in enumerate(zip(got, want, strict=True)):
        for i, (a, b) in enumerate(zip(state, state0, strict=True)):
            assert a.equal(b), f"step {step}: per-row tensor {i} {tuple(a.shape)} differs"
        np.testing.assert_array_equal(audio, audio0, err_msg=f"step {step}")
        np.testing.assert_array_equal(text, text0, err_msg=f"step {step}")


@pytest.mark.parametrize(
    ("preset", "cfg"), [("tiny", 1.0), ("tiny-hibiki", 1.0), ("tiny-hibiki", 3.0), ("tiny-zero", 1.0)]
)
def test_a_reused_slot_answers_as_a_fresh_one(preset, cfg):
    """Under guidance (``cfg`` 3) the LM holds each slot's rows twice, conditioned and not."""
    x, other = signal(5, 6), signal(9, 11)
    want = session(engine_of(preset, cfg=cfg), x, None)
    engine = engine_of(preset, cfg=cfg)
    session(engine, other, None)
    engine.end_input(0, 3)  # an earlier session that ended its input, too
    session(engine, other, None)
    assert_same(session(engine, x, None), want)


@pytest.mark.parametrize("cache_mb", [1024, 0])
def test_a_reused_personaplex_slot_answers_as_a_fresh_one(personaplex_checkpoint, cache_mb):
    x, other = signal(5, 6), signal(9, 11)
    cases = [PROMPT, {**PROMPT, "voice_prompt": "voice.pt"}, {"voice_prompt": "voice.wav"}, {}]
    wants = []
    for params in cases:  # each on a fresh engine: its first session
        wants.append(session(engine_of("tiny-personaplex", personaplex_checkpoint, cache_mb), x, params))
    engine = engine_of("tiny-personaplex", personaplex_checkpoint, cache_mb)
    session(engine, other, OTHER)
    for params, want in zip(cases + cases, wants + wants, strict=True):  # twice: cache hits the second time
        assert_same(session(engine, x, params), want)
        session(engine, other, {"voice_prompt": "voice.pt"})


def test_the_check_can_fail():
    """A reset that leaves LMGen's token cache, as moshi's own does, is caught (issue 66)."""
    from duplexserve.engine_bridge.moshi.slot_state import SlotState

    x, other = signal(5, 6), signal(9, 11)
    want = session(engine_of("tiny"), x, None)
    engine = engine_of("tiny")
    session(engine, other, None)
    slots, cache = engine._slots, engine.lm_gen._streaming_state.cache
    every = slots.entries

    def without_the_cache(mask: Any) -> None:
        slots.entries = [e for e in every if e.tensor is not cache]
        try:
            SlotState.reset(slots, mask)
        finally:
            slots.entries = every

    slots.reset = without_the_cache  # type: ignore[method-assign]
    with pytest.raises(AssertionError, match="per-row tensor"):
        assert_same(session(engine, x, None), want)
