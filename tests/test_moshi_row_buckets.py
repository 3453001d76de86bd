"""A step runs only the rows its sessions need (row_buckets.py), and no session can tell.

Sessions open and close so that the bucket changes nearly every step and live sessions
are moved down into the rows of ended ones mid-stream (KV rings wrapping, Mimi's and
LMGen's state, offsets); each must still equal Kyutai's batch-1 loop token for token, and
the engine must answer exactly as one that steps its full batch every time. Float64, as
in test_moshi_equivalence.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from duplexserve.engine_bridge.moshi import row_buckets
from duplexserve.engine_bridge.moshi.engine import MoshiEngine, Sampling
from duplexserve.engine_bridge.moshi.reference import server_loop, stock_models
from duplexserve.engine_bridge.moshi.row_buckets import RING_SLOTS, RowMap, bucket_sizes
from tests.test_moshi_equivalence import CONTEXT, run_sessions

# (slot, first step, frames, steps skipped) in 6 slots: three sessions end at step 9-10,
# so the two in rows 4 and 5 move down; slot 1 is taken again, and later ends move more.
SESSIONS = [
    (0, 0, 30, ()),
    (1, 0, 9, ()),
    (2, 0, 9, (4,)),
    (3, 1, 9, ()),
    (4, 1, 28, (12,)),
    (5, 2, 26, ()),
    (1, 14, 20, (20,)),
]


def make_engine(**kwargs) -> MoshiEngine:
    engine = MoshiEngine(
        6, "tiny", context=CONTEXT, sampling=Sampling(greedy=True), threads=1, dtype="float64", **kwargs
    )
    engine.start()
    return engine


def test_bucket_sizes_pad_by_at_most_half():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 3, 4, 6]
    sizes = bucket_sizes(384)
    assert sizes == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384]
    rows = RowMap(384, sizes)
    assert all(rows.bucket(top) <= 1.5 * top for top in range(1, 385))


def test_rows_take_the_lowest_free_and_move_down_only_past_their_bucket():
    rows = RowMap(8, bucket_sizes(8))
    for slot in (7, 3, 5, 0, 6):
        rows.open(slot)
    assert rows.row_of[[7, 3, 5, 0, 6]].tolist() == [0, 1, 2, 3, 4]
    rows.reset[:] = False
    rows.close(3)
    rows.close(5)  # 3 live in rows 0, 3, 4: bucket 3 does not hold them
    dst, src = rows.compaction()
    assert (dst.tolist(), src.tolist()) == ([1, 2], [3, 4])
    assert rows.row_of[[7, 0, 6]].tolist() == [0, 1, 2] and rows.bucket(3) == 3
    assert rows.compaction()[0].size == 0
    rows.open(2)  # a new session fills the lowest hole, due for its reset
    assert rows.row_of[2] == 3 and rows.reset.tolist() == [False] * 3 + [True] + [False] * 4
    rows.close(7)  # 3 live in rows 1-3: bucket 3 still needs a move, bucket 4 would not
    assert rows.compaction()[1].tolist() == [3] and rows.row_of[2] == 0 and rows.reset[0]


def test_a_step_moves_at_most_its_limit_highest_rows_first():
    rows = RowMap(12, bucket_sizes(12))
    for slot in range(12):
        rows.open(slot)
    for slot in (0, 1, 2, 4, 5, 6, 7):
        rows.close(slot)  # 5 live in rows 3, 8-11: bucket 6 holds them once 8-11 move down
    assert rows.overflow().tolist() == [8, 9, 10, 11]
    assert [x.tolist() for x in rows.compaction(limit=3)] == [[0, 1, 2], [9, 10, 11]]
    assert rows.overflow().tolist() == [8]
    assert [x.tolist() for x in rows.compaction(limit=3)] == [[4], [8]]
    assert rows.overflow().size == 0 and rows.row_of[[3, 8, 9, 10, 11]].tolist() == [3, 4, 0, 1, 2]


def test_sessions_moved_between_rows_equal_kyutais_batch1_loop():
    engine = make_engine(kv_layout="ring")  # a ring row moves its filled slots (paged: its pages stay)
    try:
        assert engine._rows.sizes == [1, 2, 3, 4, 6]  # every state of the model has views
        views, copied = engine._rows.views, []
        assert len(views.prefixed) == len(engine.lm_gen.lm_model.transformer.layers)  # the LM's rings
        live_prefix = views.live_prefix
        views.live_prefix = lambda src: copied.append(live_prefix(src)) or copied[-1]
        outputs, tokens, inputs = run_sessions(engine, SESSIONS)
        assert engine._rows.moves >= 3
        assert copied and all(0 < n <= CONTEXT for n in copied) and min(copied) < CONTEXT, copied
        models = stock_models(engine, CONTEXT)
        for out, tok, x in zip(outputs, tokens, inputs, strict=True):
            ref_audio, ref_tokens = server_loop(models, x)
            np.testing.assert_array_equal(tok, ref_tokens)
            np.testing.assert_allclose(out, ref_audio, rtol=0, atol=1e-6)
    finally:
        engine.stop()


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_bucket_changes_answer_as_the_full_batch(monkeypatch, kv_dtype):
    """The same sessions through an engine stepping its full batch every time: the same
    tokens, the same audio (the 8-bit ring too, whose scales move with the rows), and so
    with a move of one row a step (the rest moved in the steps after)."""
    answers = []
    for sizes, move_bytes in ((bucket_sizes, 1), (bucket_sizes, None), (lambda rows: [rows], None)):
        monkeypatch.setattr(row_buckets, "bucket_sizes", sizes)
        engine = make_engine(kv_dtype=kv_dtype)
        try:
            if move_bytes is not None:
                engine._rows.move_bytes = move_bytes
            answers.append(run_sessions(engine, SESSIONS)[:2])
            assert (engine._rows.moves > 0) == (sizes is bucket_sizes)
        finally:
            engine.stop()
    *bucketed, (full_audio, full_tokens) = answers
    for audio, tokens in bucketed:
        for a, b in zip(tokens, full_tokens, strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(audio, full_audio, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def same_answers(one: tuple[list, list], other: tuple[list, list]) -> None:
    """Two runs' (audio, tokens) of ``run_sessions``, equal bit for bit, session by session."""
    for mine, theirs in zip(one, other, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a, b)


def ring_buffers(engine: MoshiEngine) -> set[int]:
    """The ids of the KV rings' slot buffers (keys and values, the 8-bit ring's scales)."""
    rings = [getattr(state, "kv_cache", None) for state in engine._rows.views.by_size[engine.num_slots]]
    return {id(getattr(ring, name)) for ring in rings for name in ("cache", "scale") if hasattr(ring, name)}


def warm_every_bucket(engine: MoshiEngine) -> None:
    """``engine._warm_bucket`` at every bucket size, checking that no row's state changed."""
    views, rings = engine._rows.views, ring_buffers(engine)
    before = [t.clone() for t, _ in views.tensors]
    for size in engine._rows.sizes:
        engine._warm_bucket(size)
    for (after, axis), was in zip(views.tensors, before, strict=True):
        if id(after) not in rings:
            assert torch.equal(after, was)
            continue
        # A masked row writes its next slot, as one without a frame does: the step that
        # comes writes it first (Mimi's transformers take two a step).
        at = (after != was).nonzero()
        for row in at[:, axis].unique():
            assert len(at[at[:, axis] == row, RING_SLOTS].unique()) <= 2


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_warm_steps_between_live_steps_change_no_session(kv_dtype):
    """A bucket captured after ready (``_warm_bucket``, ``--moshi-warm-rows``) runs a step's
    kernels with every row masked off: run before every step at every bucket size, it leaves
    every row's state as it was and every session's answer as an engine without them."""
    answers = []
    for warm in (False, True):
        engine = make_engine(kv_dtype=kv_dtype)
        try:
            if warm:
                step = engine.step

                def step_after_warm_ups(slots, frames, engine=engine, step=step):
                    warm_every_bucket(engine)
                    return step(slots, frames)

                engine.step = step_after_warm_ups
            answers.append(run_sessions(engine, SESSIONS)[:2])
        finally:
            engine.stop()
    same_answers(*answers)


def test_warm_steps_keep_a_prompted_models_held_codes():
    """PersonaPlex's rows hear their user codes a step late (``_hold_back``): a warm-up step
    with every row masked off keeps the held codes too, and the answers are the same."""
    answers = []
    for warm in (False, True):
        engine = MoshiEngine(
            4, "tiny-personaplex", context=CONTEXT, sampling=Sampling(greedy=True), threads=1, dtype="float64"
        )
        engine.start()
        try:
            rng, audio = np.random.default_rng(0), []
            for slot in (0, 1, 2):
                engine.open(slot, {})
            for step in range(12):
                if warm:
                    warm_every_bucket(engine)
                slots = np.array([0, 1, 2] if step % 3 else [0, 2])  # slot 1 skips every third
                frames = (0.1 * rng.standard_normal((len(slots), 1920))).astype(np.float32)
                audio.append(engine.step(slots, frames).audio.copy())
            answers.append(audio)
        finally:
            engine.stop()
    for a, b in zip(*answers, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_step_in_an_uncaptured_bucket_runs_padded_in_a_captured_one_and_answers_the_same():
    """With only the 1- and 6-row buckets captured (capture_plan.py: ``--moshi-warm-rows 1``
    before its idle captures), every step of 2-4 rows runs in the 6-row bucket, its padding
    rows masked off, never in its own: and each session's tokens and audio are those of the
    engine stepping each in its own bucket, bit for bit."""
    from duplexserve.engine_bridge.moshi.capture_plan import CapturePlan

    answers, ran = [], []
    for padded in (False, True):
        engine = make_engine()
        try:
            if padded:
                engine._capture = CapturePlan(engine._rows.sizes, warm_rows=1)
                for size in (1, 6):
                    engine._capture.mark(size)
                use = engine._rows.views.use
                engine._rows.views.use = lambda size, use=use: ran.append(size) or use(size)
            answers.append(run_sessions(engine, SESSIONS)[:2])
        finally:
            engine.stop()
    assert set(ran) == {1, 6} and ran.count(6) > 10, ran
    (audio, tokens), (padded_audio, padded_tokens) = answers
    for a, b in zip(tokens, padded_tokens, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(audio, padded_audio, strict=True):
        np.testing.assert_array_equal(a, b)
