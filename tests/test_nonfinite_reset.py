"""A reset leaves nothing of the last session that any kernel may read (issue 73).

Samples no audio holds (NaN, infinities, 3e38 in a float32 model) are refused at the edge
now (tests/test_nonfinite_audio.py); here they go straight into the engine, as if they got
past it, and the session after them in the same slot must answer bit for bit as a fresh
engine's first session: Mimi's encoder attends over its whole KV ring with a boolean mask,
so a masked NaN still enters its arithmetic, and a reset must clear what the last session
left there (slot_state.py). A second check fills every KV ring's data of the slot with NaN
once its session has closed, whatever wrote them: no kernel the next session runs may read
any of it (the LM's CPU fallback zeroes the slots past a row's length, live_lm.py).
Tiny presets, greedy, float64 (float32 for 3e38, which overflows there) on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_moshi_equivalence import signal
from tests.test_slot_state import CONTEXT, PROMPT, assert_same, session

pytest.importorskip("moshi")

from duplexserve.engine_bridge.moshi.engine import MoshiEngine, Sampling


def engine_of(preset: str = "tiny", dtype: str = "float64", checkpoint=None, **options) -> MoshiEngine:
    engine = MoshiEngine(
        1, preset, weights=str(checkpoint or ""), context=CONTEXT, sampling=Sampling(greedy=True),
        threads=1, dtype=dtype, voice_dir=str(checkpoint / "voices") if checkpoint else "", **options,
    )  # fmt: skip
    engine.start()
    return engine


@pytest.mark.parametrize("mimi_attention", ["stock", "live"])
@pytest.mark.parametrize(
    ("value", "dtype"),
    [(np.nan, "float64"), (np.inf, "float64"), (-np.inf, "float64"), (3e38, "float32")],
    ids=["nan", "+inf", "-inf", "3e38-float32"],
)
def test_a_slot_after_non_finite_audio_answers_as_a_fresh_one(mimi_attention, value, dtype):
    x = signal(5, 6)
    want = session(engine_of(dtype=dtype, mimi_attention=mimi_attention), x, None)
    engine = engine_of(dtype=dtype, mimi_attention=mimi_attention)
    bad = signal(9, 11)
    bad[3, 100:200] = value  # mid-session: the ring holds it, and finite frames after it
    session(engine, bad, None)
    assert_same(session(engine, x, None), want)


def _poison_rings(engine: MoshiEngine) -> int:
    """NaN into the data of every KV ring of the slot (what a reset leaves unless it clears it)."""
    rings = [e.tensor for e in engine._slots.entries if e.fresh is None and e.tensor.is_floating_point()]
    for tensor in rings:
        tensor.fill_(float("nan"))
    return len(rings)


@pytest.mark.parametrize(
    ("preset", "options"),
    [("tiny", {}), ("tiny", {"mimi_attention": "stock"}), ("tiny", {"kv_dtype": "int8"}), ("tiny-zero", {})],
    ids=["tiny", "tiny-mimi-stock", "tiny-int8-ring", "tiny-zero"],
)
def test_no_kernel_reads_what_a_reset_row_held(preset, options):
    x = signal(5, 6)
    want = session(engine_of(preset, **options), x, None)
    engine = engine_of(preset, **options)
    session(engine, signal(9, 11), None)
    assert _poison_rings(engine) >= 2  # Mimi's rings and the LM's at least
    assert_same(session(engine, x, None), want)


def test_a_prompted_slot_reads_nothing_its_last_session_held(personaplex_checkpoint):
    """A prompt's prefill attends over the LM's ring too (live_lm.py's ``_prefill``)."""
    x = signal(5, 6)
    options = {"checkpoint": personaplex_checkpoint, "prompt_cache_mb": 0}
    want = session(engine_of("tiny-personaplex", **options), x, PROMPT)
    engine = engine_of("tiny-personaplex", **options)
    session(engine, signal(9, 11), PROMPT)
    _poison_rings(engine)
    assert_same(session(engine, x, PROMPT), want)
