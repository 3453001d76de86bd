"""PersonaPlex served as NVIDIA's server runs it: 16 depformer steps, a prompt before each session.

A tiny checkpoint in PersonaPlex's released layout (its stub config.json, ``model.safetensors``
with every one of the depformer's steps, the Mimi and SentencePiece files under NVIDIA's
names; the ``tiny-personaplex`` preset supplies the architecture the stub leaves out) and
a voice of each kind (a ``.wav``, and the ``.pt`` NVIDIA's server saves from it). The
engine cuts the depformer to the agent's steps and runs each prompt as one prefill; the
reference is NVIDIA's loop (``reference.personaplex_loop``): every depformer step, the
user's tokens forced into it, the prompt stepped a frame at a time, its own offsets.
Greedy, float64: every token equal.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from duplexserve.engine_bridge.engine import PromptError
from duplexserve.engine_bridge.moshi.checkpoint import CheckpointSource, resolve_checkpoint
from duplexserve.engine_bridge.moshi.engine import MoshiEngine, Sampling
from duplexserve.engine_bridge.moshi.presets import get_preset
from duplexserve.engine_bridge.moshi.prompts import load_voice
from duplexserve.engine_bridge.moshi.reference import lm_tokens, personaplex_loop
from tests.personaplex_checkpoint import CONTEXT, PRESET, reference
from tests.test_moshi_equivalence import signal

pytest.importorskip("moshi")

# CONTEXT (tests/personaplex_checkpoint.py): the first session below runs past it
TEXT = "hello duplex"
# (slot, first step, frames, prompt): sessions joining and leaving a batch of live ones,
# slot 1 taken again, a prompt joining while three others stream
SESSIONS = [
    (0, 0, 44, {"text_prompt": TEXT, "voice_prompt": "voice.wav"}),
    (1, 2, 6, {}),
    (2, 3, 12, {"voice_prompt": "voice.pt"}),
    (1, 9, 8, {"text_prompt": "every slot"}),
    (3, 10, 5, {"text_prompt": TEXT}),
    (2, 16, 6, {"voice_prompt": "voice.pt"}),  # a prompt run before: its cached keys and values
]


@pytest.fixture(scope="module")
def checkpoint(personaplex_checkpoint) -> Path:
    """The released layout, random weights, and the voices folder beside it (conftest.py)."""
    return personaplex_checkpoint


def engine_for(folder: Path) -> MoshiEngine:
    engine = MoshiEngine(
        4, preset=PRESET, weights=str(folder), sampling=Sampling(greedy=True), threads=1, dtype="float64",
        context=CONTEXT, voice_dir=str(folder / "voices"),
    )  # fmt: skip
    engine.start()
    return engine


def run(engine: MoshiEngine, sessions: list) -> tuple[list, list, list]:
    """Stream ``sessions`` through the engine: each one's audio, tokens and input."""
    inputs = [signal(30 + i, n) for i, (_, _, n, _) in enumerate(sessions)]
    sent = [0] * len(sessions)
    audio: list[list[np.ndarray]] = [[] for _ in sessions]
    tokens: list[list[np.ndarray]] = [[] for _ in sessions]
    with lm_tokens(engine) as batch_tokens:
        for step in range(max(start + n for _, start, n, _ in sessions)):
            live = []
            for i, (slot, start, n, params) in enumerate(sessions):
                if step == start:
                    engine.open(slot, {})
                    if params:  # else the default prompt runs at its first step
                        engine.prompt(slot, params)
                if start <= step and sent[i] < n:
                    live.append(i)
            slots = np.array([sessions[i][0] for i in live])
            result = engine.step(slots, np.stack([inputs[i][sent[i]] for i in live]))
            rows = engine.rows_of(slots)
            for j, i in enumerate(live):
                audio[i].append(result.audio[j].copy())
                tokens[i].append(batch_tokens[-1][rows[j], :, 0].cpu().numpy())
                sent[i] += 1
                if sent[i] == sessions[i][2]:
                    engine.close(sessions[i][0])
    return [np.stack(a) for a in audio], [np.stack(t) for t in tokens], inputs


def expected(folder: Path, engine: MoshiEngine, params: dict, frames: np.ndarray) -> tuple:
    models = reference(folder)
    text = (
        engine.tokenizer.encode(f"<system> {params['text_prompt']} <system>")
        if params.get("text_prompt")
        else []
    )
    voice = None
    if params.get("voice_prompt"):
        voice = load_voice(
            folder / "voices" / params["voice_prompt"], models[0], models[1].dim, models[1].num_codebooks
        )
    audio, tokens, _ = personaplex_loop(models, frames, engine._layout, text, voice)
    return audio, tokens


def test_each_prompted_session_equals_nvidias_loop(checkpoint):
    engine = engine_for(checkpoint)
    try:
        assert engine.lm_gen.lm_model.dep_q == 4 and engine.mimi.num_codebooks == 4  # the agent's steps
        audio, tokens, inputs = run(engine, SESSIONS)
        for (_, _, _, params), out, tok, x in zip(SESSIONS, audio, tokens, inputs, strict=True):
            ref_audio, ref_tokens = expected(checkpoint, engine, params, x)
            np.testing.assert_array_equal(tok, ref_tokens, err_msg=str(params))
            np.testing.assert_allclose(out, ref_audio, rtol=0, atol=1e-6, err_msg=str(params))
    finally:
        engine.stop()


def test_prompts_steer_the_answer_and_the_same_prompt_answers_the_same(checkpoint):
    engine = engine_for(checkpoint)
    try:
        same = {"text_prompt": TEXT, "voice_prompt": "voice.pt"}
        other = {"text_prompt": "every session"}
        tokens = run_same_input(engine, [(0, 10, same), (1, 10, same), (2, 10, other), (3, 10, {})])
        np.testing.assert_array_equal(tokens[0], tokens[1])
        assert not np.array_equal(tokens[0], tokens[2])
        assert not np.array_equal(tokens[2], tokens[3])
    finally:
        engine.stop()


def run_same_input(engine: MoshiEngine, sessions: list) -> list[np.ndarray]:
    """Sessions ``(slot, frames, prompt)`` opened together, all hearing the same input: their tokens."""
    frames = signal(5, max(n for _, n, _ in sessions))
    for slot, _, params in sessions:
        engine.open(slot, {})
        engine.prompt(slot, params)
    slots = np.array([slot for slot, _, _ in sessions])
    out = []
    with lm_tokens(engine) as batch_tokens:
        for frame in frames:
            engine.step(slots, np.repeat(frame[None], len(slots), axis=0))
            out.append(batch_tokens[-1][engine.rows_of(slots), :, 0].cpu().numpy())
    return list(np.stack(out, axis=1))


def test_a_pt_voice_answers_as_the_wav_it_was_saved_from(checkpoint):
    engine = engine_for(checkpoint)
    try:
        wav = {"text_prompt": TEXT, "voice_prompt": "voice.wav"}
        pt = {"text_prompt": TEXT, "voice_prompt": "voice.pt"}
        tokens = run_same_input(engine, [(0, 8, wav), (1, 8, pt)])
        np.testing.assert_array_equal(tokens[0], tokens[1])
    finally:
        engine.stop()


def test_an_unknown_voice_is_refused_by_name(checkpoint):
    engine = engine_for(checkpoint)
    try:
        assert engine.takes_prompts and engine.voices == ("voice.pt", "voice.wav")
        engine.open(0, {})
        with pytest.raises(PromptError, match=r"NATF9\.pt") as refused:
            engine.prompt(0, {"voice_prompt": "NATF9.pt"})
        assert refused.value.code == "voice_not_found"
    finally:
        engine.stop()


def test_the_stub_config_takes_personaplex_7b_unless_a_preset_of_its_kind_is_named(checkpoint):
    full = resolve_checkpoint(CheckpointSource(weights=str(checkpoint)))
    assert full.lm_config["dim"] == 4096 and full.lm_config["dep_q"] == 16
    tiny = resolve_checkpoint(CheckpointSource(weights=str(checkpoint), preset=PRESET))
    assert tiny.lm_config["dim"] == get_preset(PRESET).lm["dim"] and tiny.model_type == "personaplex"
