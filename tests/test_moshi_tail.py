"""After input.end the model finishes its answer as its reference code has it finish.

A dialogue model (moshi) is stepped on silence for its delay; a translation model
(Hibiki) gets one end-of-input frame (codes ``card`` on every codebook, not encoded by
Mimi, as moshi's run_inference feeds it) and then silence until it samples its end of
text or the tail's limit. Each session's whole output, input and tail, must equal
moshi.server's batch-1 loop stepped on the same frames (greedy, float64), while another
session streams beside it in the same batch. Then the same through the real server.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import websockets.asyncio.client

from duplexserve.engine_bridge.engine import Tail
from duplexserve.engine_bridge.moshi.engine import MoshiEngine, Sampling
from duplexserve.engine_bridge.moshi.reference import FRAME, lm_tokens, server_loop, stock_models
from tests.test_moshi_equivalence import CONTEXT, signal

EOS = 2  # the text token that ends a Hibiki translation
LIMIT = 5  # tail frames at most (--drain-max-s 0.4)


def force_eos(lm) -> None:  # type: ignore[no-untyped-def]
    """Make the text head prefer the end of text at every step, in any LM it is given."""

    def prefer_eos(_module, _inputs, logits):  # type: ignore[no-untyped-def]
        bonus = logits.new_zeros(logits.shape)
        bonus[..., EOS] = 1e4
        return logits + bonus

    lm.text_linear.register_forward_hook(prefer_eos)


def serve_with_tails(engine: MoshiEngine, inputs: dict[int, np.ndarray], ending: set[int]):  # type: ignore[no-untyped-def]
    """Step every slot's input; the slots in ``ending`` then get input.end and their tail
    (at most LIMIT frames, or until a step says the row finished). Each slot's audio out,
    tokens out, and the frames it was stepped on."""
    fed = {slot: list(x) for slot, x in inputs.items()}
    stepped: dict[int, list[np.ndarray]] = {slot: [] for slot in inputs}
    audio: dict[int, list[np.ndarray]] = {slot: [] for slot in inputs}
    tokens: dict[int, list[np.ndarray]] = {slot: [] for slot in inputs}
    tail_left = {slot: 0 for slot in inputs}
    for slot in inputs:
        engine.open(slot, {})
    with lm_tokens(engine) as batch_tokens:
        while True:
            slots = []
            for slot in inputs:
                if len(stepped[slot]) == len(inputs[slot]) and slot in ending:
                    engine.end_input(slot, len(inputs[slot]))  # as the bridge tells it, before the tail
                    ending.discard(slot)
                    tail_left[slot] = engine.tail.frames or LIMIT
                if len(stepped[slot]) < len(fed[slot]) or tail_left[slot]:
                    slots.append(slot)
            if not slots:
                break
            frames = []
            for slot in slots:
                if len(stepped[slot]) >= len(fed[slot]):  # the tail: silence
                    fed[slot].append(np.zeros(FRAME, np.float32))
                    tail_left[slot] -= 1
                frames.append(fed[slot][len(stepped[slot])])
                stepped[slot].append(frames[-1])
            result = engine.step(np.array(slots), np.stack(frames))
            where = engine.rows_of(np.array(slots))
            for row, slot in enumerate(slots):
                audio[slot].append(result.audio[row].copy())
                if len(stepped[slot]) > engine.delay_frames:
                    tokens[slot].append(batch_tokens[-1][where[row], :, 0].cpu().numpy())
                if result.finished and row in result.finished:
                    tail_left[slot] = 0
    return audio, tokens, stepped


@pytest.mark.parametrize(
    "preset,eos,tail",
    [
        ("tiny", False, 1),  # moshi: its delay, one frame
        ("tiny-hibiki", False, LIMIT),  # the model never ends: the limit
        ("tiny-hibiki", True, 1),  # it ends at the end-of-input frame itself
    ],
)
def test_the_tail_equals_the_reference_stepped_on_the_same_frames(preset, eos, tail):
    engine = MoshiEngine(
        4, preset, context=CONTEXT, sampling=Sampling(greedy=True), threads=1, dtype="float64"
    )
    engine.start()
    try:
        hibiki = engine.model_type == "hibiki"
        assert engine.tail == (Tail(until_done=True) if hibiki else Tail(frames=engine.delay_frames))
        models = stock_models(engine, CONTEXT)
        if eos:
            force_eos(engine.lm_gen.lm_model)
            force_eos(models[1])
        inputs = {0: signal(30, 6), 1: signal(31, 14), 2: signal(32, 4)}
        audio, tokens, stepped = serve_with_tails(engine, inputs, ending={0, 2})
        for slot in (0, 2):
            n = len(inputs[slot])
            assert len(stepped[slot]) == n + tail, (slot, len(stepped[slot]))
            ref_audio, ref_tokens = server_loop(
                models, np.stack(stepped[slot]), end_of_input=n if hibiki else None
            )
            np.testing.assert_array_equal(np.stack(tokens[slot]), ref_tokens)
            np.testing.assert_allclose(np.stack(audio[slot]), ref_audio, rtol=0, atol=1e-6)
            if eos:
                assert ref_tokens[-1][0] == EOS  # the reference ends there too
        ref_audio, ref_tokens = server_loop(models, inputs[1])  # beside them, no end of input
        np.testing.assert_array_equal(np.stack(tokens[1]), ref_tokens)
    finally:
        engine.stop()


async def converse_to_end(url: str, frames: int) -> dict:
    x = signal(40, frames)
    async with websockets.asyncio.client.connect(url, max_size=None) as ws:
        await ws.recv()
        await ws.send(x.tobytes())
        await ws.send(json.dumps({"type": "input.end"}))
        received = 0
        async for message in ws:
            if isinstance(message, bytes):
                received += 1
            elif (event := json.loads(message))["type"] == "session.closed":
                event["received"] = received
                return event
    raise AssertionError("no session.closed")


@pytest.mark.parametrize("preset,tail", [("tiny", 1), ("tiny-hibiki", LIMIT)])
def test_input_end_through_the_server_counts_the_tail(server_factory, preset, tail):
    server = server_factory(
        "--engine", "moshi", "--moshi-preset", preset, "--moshi-greedy", "--moshi-threads", "1",
        "--max-sessions", "4", "--drain-max-s", "0.4",
    )  # fmt: skip
    closed = asyncio.run(converse_to_end(server.ws(), 7))
    assert closed["reason"] == "completed"
    assert (closed["frames_in"], closed["frames_out"], closed["frames_tail"]) == (7, 7 + tail, tail)
    assert closed["frames_dropped"] == 0 and closed["received"] == 7 + tail
