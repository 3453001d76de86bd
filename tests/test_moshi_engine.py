"""The moshi engine on the CPU with the tiny preset: real Mimi + LM code, random weights.

Greedy decoding makes the model a deterministic function of each slot's own input
history, so "the same input gives the same output" checks slot isolation, resets and
every transport (thread, process, local weights) exactly. A step runs only the rows its
sessions need (row_buckets.py), so a session alone and one among others run at different
batch sizes, which in float32 round differently in the CPU's matrix products (1e-7): the
tests that compare those run in float64, where the rounding stays below the output's.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import numpy as np
import pytest

from duplexserve.config import ServerConfig
from duplexserve.engine_bridge.moshi.engine import MoshiEngine, Sampling
from duplexserve.engine_bridge.moshi.presets import TINY_LM, TINY_MIMI
from duplexserve.engine_bridge.moshi.toy_tokenizer import TOY_TOKENIZER
from duplexserve.engine_bridge.process_engine import ProcessEngine

SLOTS = 4
FRAMES = 12


def signal(seed: int, frames: int = FRAMES) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((frames, 1920)) * 0.1).astype(np.float32)


def make_engine(**kwargs) -> MoshiEngine:
    engine = MoshiEngine(SLOTS, "tiny", sampling=Sampling(greedy=True), threads=1, **kwargs)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine() -> Iterator[MoshiEngine]:
    engine = make_engine()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def engine64() -> Iterator[MoshiEngine]:
    engine = make_engine(dtype="float64")
    yield engine
    engine.stop()


def run(engine, inputs: dict[int, np.ndarray], opens: bool = True) -> dict[int, np.ndarray]:
    """Stream each slot's frames (slots of different lengths drop out as they end)."""
    if opens:
        for slot in inputs:
            engine.open(slot, {})
    outputs: dict[int, list[np.ndarray]] = {slot: [] for slot in inputs}
    for i in range(max(len(x) for x in inputs.values())):
        slots = np.array([s for s, x in inputs.items() if i < len(x)])
        result = engine.step(slots, np.stack([inputs[s][i] for s in slots]))
        assert result.audio.shape == (len(slots), 1920) and result.audio.dtype == np.float32
        for row, slot in enumerate(slots.tolist()):
            outputs[slot].append(result.audio[row].copy())
    for slot in inputs:
        engine.close(slot)
    return {slot: np.stack(frames) for slot, frames in outputs.items()}


def test_one_output_per_input_silence_only_for_the_model_delay(engine):
    assert engine.delay_frames == max(TINY_LM["delays"]) == 1
    out = run(engine, {0: signal(1), 2: signal(2, 7)})
    for slot, frames in ((0, FRAMES), (2, 7)):
        assert out[slot].shape == (frames, 1920)
        level = np.abs(out[slot]).max(axis=1)
        assert (level[: engine.delay_frames] == 0).all()
        assert (level[engine.delay_frames :] > 0).all()


def test_a_slot_does_not_hear_its_neighbours(engine64):
    engine = engine64
    alone = run(engine, {1: signal(1)})[1]
    crowded = run(engine, {0: signal(7), 1: signal(1), 2: signal(8), 3: signal(9)})
    np.testing.assert_allclose(crowded[1], alone, rtol=0, atol=1e-6)
    assert not np.array_equal(crowded[0], alone)


def test_sessions_open_and_close_while_another_streams(engine64):
    engine = engine64
    alone = run(engine, {0: signal(1, 24)})[0]
    engine.open(0, {})
    x = signal(1, 24)
    got = []
    for i in range(24):
        slots = [0]
        if i % 6 == 1:  # a new session takes slot 1 or 2 while slot 0 goes on
            engine.open(1 + (i // 6) % 2, {})
        if i % 6 in (1, 2, 3):
            slots.append(1 + (i // 6) % 2)
        if i % 6 == 4:
            engine.close(1 + (i // 6) % 2)
        frames = np.stack([x[i]] + [signal(100 + i, 1)[0]] * (len(slots) - 1))
        got.append(engine.step(np.array(slots), frames).audio[0].copy())
    engine.close(0)
    np.testing.assert_allclose(np.stack(got), alone, rtol=0, atol=1e-6)


def test_reset_gives_a_new_session_a_fresh_state(engine):
    first = run(engine, {3: signal(5)})[3]
    run(engine, {3: signal(6, 20), 0: signal(4)})  # another occupant, longer
    again = run(engine, {3: signal(5)})[3]
    np.testing.assert_array_equal(again, first)
    # The check can fail: the same slot without its reset answers differently.
    stale = run(engine, {3: signal(5)}, opens=False)[3]
    assert not np.array_equal(stale, first)


def _tokenizer(path) -> None:
    """The tiny presets' toy tokenizer, copied to ``path`` (a checkpoint's file)."""
    shutil.copyfile(TOY_TOKENIZER, path)


def test_local_weights_and_tokenizer(engine, tmp_path):
    from safetensors.torch import save_file

    save_file(engine.lm_gen.lm_model.state_dict(), str(tmp_path / "lm.safetensors"))
    save_file(engine.mimi.state_dict(), str(tmp_path / "mimi.safetensors"))
    (tmp_path / "mimi.json").write_text(json.dumps(TINY_MIMI))
    config = {
        **TINY_LM,
        "moshi_name": "lm.safetensors",
        "mimi_name": "mimi.safetensors",
        "mimi_config_name": "mimi.json",
        "tokenizer_name": "spm.model",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    _tokenizer(tmp_path / "spm.model")
    reference = run(engine, {0: signal(3)})[0]
    loaded = make_engine(weights=str(tmp_path), seed=123)  # another seed: weights must come from disk
    try:
        assert loaded.tokenizer is not None
        loaded.open(0, {})
        texts: list[str] = []
        audio = []
        for frame in signal(3):
            result = loaded.step(np.array([0]), frame[None])
            audio.append(result.audio[0])
            texts.extend(result.text.values())
        np.testing.assert_array_equal(np.stack(audio), reference)
        tokenizer = loaded.tokenizer
        pieces = {tokenizer.id_to_piece(i).replace("\u2581", " ") for i in range(tokenizer.get_piece_size())}
        assert texts and set(texts) <= pieces
    finally:
        loaded.stop()


def test_missing_weights_are_an_error_not_a_download(tmp_path):
    with pytest.raises(FileNotFoundError):
        MoshiEngine(1, weights=str(tmp_path))


def test_engine_in_its_own_process_answers_the_same(engine):
    reference = run(engine, {0: signal(1), 1: signal(2)})
    config = ServerConfig(
        engine="moshi", engine_process=True, max_sessions=SLOTS, moshi_greedy=True, moshi_threads=1
    )
    proxy = ProcessEngine(config)
    proxy.start()
    try:
        np.testing.assert_equal(run(proxy, {0: signal(1), 1: signal(2)}), reference)
    finally:
        proxy.stop()


FAILING_START = """
import json, sys
from duplexserve.config import ServerConfig
from duplexserve.engine_bridge.process_engine import EngineProcessError, ProcessEngine

overrides = json.loads(sys.argv[1])
config = ServerConfig(engine="moshi", engine_process=True, max_sessions=2, moshi_threads=1, **overrides)
try:
    ProcessEngine(config).start()
except EngineProcessError as exc:
    print(str(exc).strip().splitlines()[-1])
"""


@pytest.mark.parametrize("where", ["building", "starting"])
def test_an_engine_process_that_fails_to_start_leaves_nothing_behind(tmp_path, where):
    """A refused start (as the memory plan refuses a slot count on a GPU) stops the child and
    unlinks the shared buffers: Python's resource tracker finds nothing leaked at exit.
    Building: a missing checkpoint fails in the constructor; starting: a CUDA device on a
    CPU build of torch fails inside ``start()``, with a half-built engine to stop."""
    import subprocess
    import sys

    import torch

    if where == "starting" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the engine would start")
    overrides = {"moshi_weights": str(tmp_path)} if where == "building" else {"device": "cuda"}
    command = [sys.executable, "-c", FAILING_START, json.dumps(overrides)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("FileNotFoundError" if where == "building" else "CUDA") in done.stdout
    assert "resource_tracker" not in done.stderr and "leaked" not in done.stderr, done.stderr


def test_stock_presets_restate_the_library():
    from moshi.models import loaders

    from duplexserve.engine_bridge.moshi import presets as moshi_presets

    assert loaders._lm_kwargs == moshi_presets.MOSHI_7B_LM
    assert loaders._seanet_kwargs == moshi_presets.SEANET
    assert loaders._transformer_kwargs == moshi_presets.MIMI_TRANSFORMER
    assert moshi_presets.get_preset("hibiki-2b").max_delay == 2


def test_the_moshi_engine_on_a_gpu_runs_in_its_own_process_unless_told_not_to():
    import argparse

    def config(*flags: str) -> ServerConfig:
        parser = argparse.ArgumentParser()
        ServerConfig.add_arguments(parser)
        return ServerConfig.from_namespace(parser.parse_args(list(flags)))

    assert config("--engine", "moshi", "--device", "cuda").engine_in_process
    assert not config("--engine", "moshi", "--device", "cuda", "--no-engine-process").engine_in_process
    assert not config("--engine", "moshi", "--device", "cpu").engine_in_process
    assert not config().engine_in_process  # the synthetic engine keeps one process
    assert config("--engine-process").engine_in_process


@pytest.mark.parametrize(
    "name, other, default, refused",
    [
        ("mimi_graph", "parts", "whole", "parts or whole"),
        ("mimi_convs", "fused-cl", "fused", "stock, fused or fused-cl"),
    ],
)
def test_mimi_options_reach_the_engine_and_a_bad_value_is_refused(
    name: str, other: str, default: str, refused: str
) -> None:
    import argparse

    from duplexserve.engine_bridge.moshi.engine import moshi_engine_from_config

    parser = argparse.ArgumentParser()
    ServerConfig.add_arguments(parser)
    flags = ["--engine", "moshi", f"--moshi-{name.replace('_', '-')}", other]
    config = ServerConfig.from_namespace(parser.parse_args(flags))
    assert getattr(moshi_engine_from_config(config), name) == other
    assert getattr(MoshiEngine(1), name) == default
    with pytest.raises(ValueError, match=refused):
        MoshiEngine(1, **{name: "all"})


def test_fp32_matmul_reaches_the_engine_and_sets_torchs_precision():
    import argparse

    import torch

    from duplexserve.engine_bridge.moshi.engine import moshi_engine_from_config

    parser = argparse.ArgumentParser()
    ServerConfig.add_arguments(parser)
    flags = ["--engine", "moshi", "--moshi-fp32-matmul", "tf32"]
    config = ServerConfig.from_namespace(parser.parse_args(flags))
    tf32 = moshi_engine_from_config(config)
    assert tf32.fp32_matmul == "tf32"
    with pytest.raises(ValueError, match="float32 or tf32"):
        MoshiEngine(1, fp32_matmul="fp16")
    matmul = torch.backends.cuda.matmul
    try:
        tf32.start()  # the CUDA flag is process-wide; the CPU's matmuls ignore it
        assert matmul.fp32_precision == "tf32"
    finally:
        tf32.stop()
        matmul.fp32_precision = "ieee"


def test_the_start_is_timed_by_phase(engine):
    """Where a start goes, in order: loading, the random Mimi's codebooks, the kernels, the
    state, each bucket's warm-up (on the CPU one bucket: no graphs to capture). Every phase
    took some time, and together they are the start."""
    phases = engine.start_phases
    assert list(phases) == ["mimi", "lm", "codebooks", "voices", "kernels", "state", f"warm-up {SLOTS}"]
    assert all(seconds >= 0 for seconds in phases.values())
    assert phases["lm"] > 0 and phases[f"warm-up {SLOTS}"] > 0
