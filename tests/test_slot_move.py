"""A session moved to another engine goes on exactly as if it had stayed (issue 76).

Engine A runs the session beside other live rows for ``k`` frames and exports its slot;
engine B, of the same model, with live rows of its own, imports it into another slot (and
so another row) and runs the rest. Every answer after the move must equal, bit for bit, an
engine that never moved it (CPU, float64, greedy: as tests/test_slot_state.py compares).
Moves early, after the LM's ring wrapped, and, for PersonaPlex, while the prompt still
forces the agent's tokens. A state of another model is ``move_mismatch``, damaged bytes
``move_corrupt``, and the bytes grow with the frames the session used, not with the ring.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.test_moshi_equivalence import signal

pytest.importorskip("moshi")

from duplexserve.engine_bridge.engine import MoveRefused
from duplexserve.engine_bridge.moshi import slot_export
from duplexserve.engine_bridge.moshi.engine import MoshiEngine, Sampling
from duplexserve.engine_bridge.moshi.toy_tokenizer import TOY_TOKENIZER

CONTEXT = 16  # a ring the tests wrap in a few frames
FRAMES = 24
SLOTS = 3
PROMPTED = {"text_prompt": "hello duplex", "voice_prompt": "voice.pt"}


def engine_of(preset: str, checkpoint: Path | None = None, slots: int = SLOTS, **kwargs: Any) -> MoshiEngine:
    given = {"context": CONTEXT, "sampling": Sampling(greedy=True), "threads": 1, "dtype": "float64",
             "kv_layout": "paged"}  # the ring's cases name it (prompted models and guidance keep it)
    kwargs = given | kwargs
    if checkpoint is not None:
        kwargs.update(weights=str(checkpoint), voice_dir=str(checkpoint / "voices"))
    else:  # text out too, as a tiny preset serves it
        kwargs.setdefault("tokenizer", str(TOY_TOKENIZER))
    engine = MoshiEngine(slots, preset, **kwargs)
    engine.start()
    return engine


def begin(engine: MoshiEngine, slot: int, params: dict[str, Any] | None) -> None:
    engine.open(slot, params or {})
    if params is not None:
        engine.prompt(slot, params)


def answer(engine: MoshiEngine, live: dict[int, np.ndarray], i: int, slot: int) -> tuple[Any, ...]:
    """Step frame ``i`` of every live slot; ``slot``'s audio, text and whether it finished."""
    slots = np.array(sorted(live))
    result = engine.step(slots, np.stack([live[s][i] for s in slots]))
    at = int(np.flatnonzero(slots == slot)[0])
    return result.audio[at].copy(), result.text.get(at), at in (result.finished or [])


def unmoved(engine: MoshiEngine, x: np.ndarray, params: dict[str, Any] | None, end: int | None) -> list:
    begin(engine, 0, params)
    if end is not None:
        engine.end_input(0, end)
    return [answer(engine, {0: x}, i, 0) for i in range(len(x))]


def moved(
    a: MoshiEngine, b: MoshiEngine, x: np.ndarray, k: int, params: dict[str, Any] | None, end: int | None
) -> tuple[list, bytes, bytes]:
    """The session in A's slot 2 (row 1) for ``k`` frames, then in B's slot 0 (row 2); its
    answers, the state exported from A and the one B exports right after importing it."""
    other, more = signal(31, FRAMES), signal(32, FRAMES)
    begin(a, 0, params and {"text_prompt": "You are a wise teacher."})
    begin(a, 2, params)
    if end is not None:
        a.end_input(2, end)
    got = [answer(a, {0: other, 2: x}, i, 2) for i in range(k)]
    if params is not None and k == 0:
        assert a._forced.get(2), "the prompt forces no more agent tokens: not a move mid-prompt"
    state = a.export_slot(2)
    row = a.rows_of(np.array([2]))[0]
    a.close(2)
    begin(b, 1, params and {"voice_prompt": "voice.pt"})
    begin(b, 2, None if params is None else {})
    for i in range(3):  # B's own sessions are under way
        answer(b, {1: more, 2: other}, i, 1)
    b.import_slot(0, state)
    assert b.rows_of(np.array([0]))[0] != row
    again = b.export_slot(0)
    got += [answer(b, {0: x, 1: more, 2: other}, i, 0) for i in range(k, len(x))]
    return got, state, again


def assert_same_state(engine: MoshiEngine, got: bytes, want: bytes) -> None:
    """The same slot state (safetensors' header may list the tensors in another order)."""
    identity = engine.move_identity()
    (slot, tensors, n), (slot0, tensors0, n0) = (slot_export.unpack(s, identity) for s in (got, want))
    assert (slot, n, sorted(tensors)) == (slot0, n0, sorted(tensors0))
    for name, tensor in tensors.items():
        assert tensor.equal(tensors0[name]), f"{name} differs"


def assert_same(got: list, want: list) -> None:
    assert any(np.abs(audio).max() > 0 for audio, _, _ in want), "the model answered silence only"
    assert any(text for _, text, _ in want), "the model answered no text"
    for i, ((audio, text, done), (audio0, text0, done0)) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(audio, audio0, err_msg=f"frame {i}")
        assert (text, done) == (text0, done0), f"frame {i}"


@pytest.mark.parametrize(
    ("preset", "kwargs", "k", "end"),
    [
        ("tiny", {}, 3, None),  # early: the ring holds 3 of its 16 slots
        ("tiny", {}, CONTEXT + 4, None),  # after the ring wrapped
        ("tiny", {"kv_dtype": "int8"}, CONTEXT + 4, None),  # int8 ring: its scales move too
        ("tiny-hibiki", {}, 6, 10),  # its end-of-input frame still to come
        ("tiny-hibiki", {"cfg_coef": 3.0}, 6, 10),  # guidance: each slot's rows twice
        ("tiny-zero", {}, CONTEXT + 2, None),
        ("tiny-zero", {"slots": SLOTS + 2}, 5, None),  # into an engine of more slots
        ("tiny", {"kv_layout": "ring"}, CONTEXT + 4, None),  # the ring's rows (the server's default)
        ("tiny-zero", {"kv_layout": "ring"}, CONTEXT + 2, None),
        ("tiny", {"kv_page": 4}, CONTEXT + 4, None),  # paged KV in pages of 4: a row's pages read back
        ("tiny", {"kv_page": 4, "kv_dtype": "int8"}, 7, None),  # ... mid-page, the scales too
    ],
)
def test_a_moved_session_answers_as_an_unmoved_one(preset, kwargs, k, end):
    x = signal(5, FRAMES)
    model = {name: value for name, value in kwargs.items() if name != "slots"}  # B's slots aside
    want = unmoved(engine_of(preset, **model), x, None, end)
    b = engine_of(preset, **kwargs)
    got, state, again = moved(engine_of(preset, **model), b, x, k, None, end)
    assert_same_state(b, again, state)
    assert_same(got, want)


@pytest.mark.parametrize(
    ("params", "k"),
    [(PROMPTED, 0), ({"voice_prompt": "voice.wav"}, 0), (PROMPTED, 1), (PROMPTED, 6)],
)
def test_a_personaplex_session_moves_mid_prompt_and_after(personaplex_checkpoint, params, k):
    """At ``k`` 0 the prompt still forces the agent's next tokens: they move with the slot."""
    x = signal(5, 10)
    make = lambda: engine_of("tiny-personaplex", personaplex_checkpoint, context=64)  # noqa: E731
    want = unmoved(make(), x, params, None)
    b = make()
    got, state, again = moved(make(), b, x, k, params, None)
    assert_same_state(b, again, state)
    assert_same(got, want)


def test_a_personaplex_session_whose_prompt_has_not_run_is_not_moved_now(personaplex_checkpoint):
    engine = engine_of("tiny-personaplex", personaplex_checkpoint, context=64)
    engine.open(1, {})
    with pytest.raises(MoveRefused, match="prompt has not run") as refused:
        engine.export_slot(1)
    assert refused.value.code == "move_not_now"


def test_the_check_can_fail(monkeypatch):
    """Without the LM's keys and values the moved session answers otherwise."""
    x = signal(5, FRAMES)
    want = unmoved(engine_of("tiny"), x, None, None)
    monkeypatch.setattr(slot_export, "put_row_kv", lambda rings, rows, kv: None)
    got, _, _ = moved(engine_of("tiny"), engine_of("tiny"), x, 6, None, None)
    with pytest.raises(AssertionError, match="frame 6"):
        assert_same(got, want)


@pytest.fixture(scope="module")
def exported() -> bytes:
    engine = engine_of("tiny")
    engine.open(0, {})
    for frame in signal(5, 4):
        engine.step(np.array([0]), frame[None])
    return engine.export_slot(0)


@pytest.mark.parametrize(
    ("preset", "kwargs", "what"),
    [
        ("tiny-zero", {}, "family"),
        ("tiny", {"context": 2 * CONTEXT}, "context"),
        ("tiny", {"kv_dtype": "int8"}, "kv_dtype"),
        ("tiny", {"kv_layout": "ring"}, "kv_layout"),  # a row's state holds the ring's own offsets
        ("tiny", {"seed": 1}, "weights"),
    ],
)
def test_another_models_state_is_refused(exported, preset, kwargs, what):
    engine = engine_of(preset, **kwargs)
    engine.open(1, {})
    with pytest.raises(MoveRefused, match=what) as refused:
        engine.import_slot(0, exported)
    assert refused.value.code == "move_mismatch"
    assert engine.rows_of(np.array([0]))[0] == -1  # the slot stays closed
    engine.step(np.array([1]), signal(1, 1))  # and the engine goes on


def test_damaged_bytes_are_refused(exported):
    engine = engine_of("tiny")
    flipped = bytearray(exported)
    flipped[len(flipped) // 2] ^= 0x40
    for damaged in (bytes(flipped), exported[:-10], b"hello", b""):
        with pytest.raises(MoveRefused) as refused:
            engine.import_slot(0, damaged)
        assert refused.value.code == "move_corrupt"
        assert engine.rows_of(np.array([0]))[0] == -1


def test_the_state_grows_with_the_frames_used_not_the_ring():
    """Each frame adds one slot of every LM layer's keys and values; a young session carries
    a few of the ring's slots, not all of them."""
    engine = engine_of("tiny", context=256)
    layers = engine.lm_gen.lm_model.transformer.layers
    rings = [layer.self_attn._streaming_state.kv_cache.cache for layer in layers]
    per_frame = sum(r[:, 0, :, 0].numel() * r.element_size() for r in rings)
    ring = 256 * per_frame
    engine.open(0, {})
    sizes = {}
    for i, frame in enumerate(signal(5, 12), start=1):
        engine.step(np.array([0]), frame[None])
        if i in (2, 12):
            sizes[i] = len(engine.export_slot(0))
    assert abs(sizes[12] - sizes[2] - 10 * per_frame) < 64  # the header's numbers aside
    assert sizes[2] < ring / 4


def test_a_session_moves_between_engine_processes():
    """``--engine-process``: the bytes and the refusals cross the child's pipe as in-process."""
    from duplexserve.config import ServerConfig
    from duplexserve.engine_bridge.process_engine import ProcessEngine

    x, other, k = signal(5, FRAMES), signal(31, FRAMES), CONTEXT + 2
    want = unmoved(engine_of("tiny"), x, None, None)
    config = ServerConfig(
        engine="moshi", engine_process=True, max_sessions=SLOTS, moshi_preset="tiny", moshi_greedy=True,
        moshi_threads=1, moshi_dtype="float64", moshi_context=CONTEXT,
    )  # fmt: skip
    a, b = ProcessEngine(config), ProcessEngine(config)
    try:
        a.start()
        b.start()
        a.open(0, {})
        a.open(2, {})
        got = [answer(a, {0: other, 2: x}, i, 2) for i in range(k)]
        state = a.export_slot(2)
        a.close(2)
        b.open(1, {})
        answer(b, {1: other}, 0, 1)
        b.import_slot(0, state)
        got += [answer(b, {0: x, 1: other}, i, 0) for i in range(k, FRAMES)]
        for engine, call, code in [
            (b, lambda: b.import_slot(2, state[:-1]), "move_corrupt"),
            (a, lambda: a.export_slot(2), "move_not_now"),  # closed: no session there
        ]:
            with pytest.raises(MoveRefused) as refused:
                call()
            assert refused.value.code == code
            assert engine.alive()
    finally:
        a.stop()
        b.stop()
    assert_same(got, want)
