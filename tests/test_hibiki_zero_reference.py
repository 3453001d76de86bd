"""A Hibiki-Zero checkpoint answers in the batched engine as ``hibiki-zero serve`` answers it.

The reference is the ``hibiki-zero`` package itself (0.0.4, installed by
scripts/install-moshi.sh without its UI dependencies): its ``inference.ServerState``,
loaded as its ``run.py serve`` loads a checkpoint (moshi's ``CheckpointInfo``, its
``lm_gen_config`` as LMGen's only sampling settings), serving one WebSocket session after
another through its own ``handle_chat`` and ``recv_loop`` (the lock, the Mimi and LMGen
resets, the handshake, the first-frame rule, ``decode_and_send``'s audio and text). Only
the transport is replaced, in that module alone: aiohttp's ``WebSocketResponse`` by a
socket that yields the client's messages and keeps the server's, and sphn's Opus reader
and writer by a lossless PCM stand-in (Opus would make the comparison approximate).

The checkpoint is ``tiny-zero`` written in the released layout (grouped KV heads,
``rope_concat``, a depformer weight schedule, depformer norms, Hibiki's conditioning)
with greedy sampling in its ``lm_gen_config`` (temperatures 0: the package has no
sampling flags), a tokenizer with a piece for every text id (the package's
``id_to_piece`` raises on any other). Both sides run in float64 (the package serves fp16
on a GPU; in float32 batch and batch-1 matmuls round apart, see test_moshi_equivalence).
The engine serves the sessions in one batch (opening and closing while others stream, a
slot taken again, steps skipped, one session past the LM's context); each must equal
the package's session on the same frames: every text and audio token, the text it sends,
its audio to 1e-6, and silence for the model's delay, where the package sends nothing.

Not compared: ``ServerState.warmup`` (float32 zeros and ``torch.cuda.synchronize``, so
GPU-only; ``handle_chat`` resets Mimi and LMGen before each session, and the sessions
here run one after another in one ``ServerState``, so what a session leaves behind is
shown not to matter) and the end of input, which the package's server does not have
(docs/moshi-engine.md, the Hibiki-Zero row).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from duplexserve.engine_bridge.moshi.engine import MoshiEngine, Sampling
from duplexserve.engine_bridge.moshi.reference import FRAME, server_loop
from tests.test_moshi_checkpoints import moshi_models, write_checkpoint
from tests.test_moshi_equivalence import run_sessions, signal

# (slot, first step, frames, steps skipped): slot 1 is taken again after its first session;
# the 30-frame session passes the LM's context of 16 frames
SESSIONS = [(0, 0, 30, ()), (1, 2, 6, ()), (2, 3, 12, (6, 7)), (1, 9, 14, (15,)), (3, 5, 4, ())]
GREEDY = {"temp": 0.0, "temp_text": 0.0}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A SentencePiece model of exactly 64 pieces: tiny-zero's text_card."""
    import sentencepiece

    text = (
        "every session is a slot of one batched streaming state. hello from the duplex engine. "
        "hibiki zero translates french spanish portuguese and german into english speech. "
        "the quick brown fox jumps over the lazy dog while the model answers frame by frame"
    )
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(text.split(". ") * 10), model_writer=model, vocab_size=64, minloglevel=2
    )
    path = tmp_path_factory.mktemp("spm") / "spm.model"
    path.write_bytes(model.getvalue())
    return path


def hibiki_zero_server(folder: Path, monkeypatch) -> Any:  # type: ignore[no-untyped-def]
    """``hibiki-zero serve --hf-repo REPO``'s ServerState, loaded as its run.py loads it, the
    Hub's files served from ``folder`` (float64 on the CPU where the package says fp16 on CUDA)."""
    import torch
    from hibiki_zero.inference import ServerState
    from moshi.models import loaders

    def from_folder(repo_id: str, filename: str, revision: str | None = None, **_: Any) -> str:
        assert (repo_id, revision) == ("kyutai/hibiki-zero-tiny", None)
        return str(folder / filename)

    monkeypatch.setattr(loaders, "hf_hub_download", from_folder)
    # run.py's serve(), from the checkpoint to ServerState, its options left at their defaults
    checkpoint_info = loaders.CheckpointInfo.from_hf_repo(
        "kyutai/hibiki-zero-tiny", None, None, None, lora_weights=None, config_path=None, revision=None
    )
    mimi = checkpoint_info.get_mimi(device="cpu").double()
    text_tokenizer = checkpoint_info.get_text_tokenizer()
    lm = checkpoint_info.get_moshi(device="cpu", dtype=torch.float64, fuse_lora=True)
    return ServerState(
        checkpoint_info.model_type, mimi, text_tokenizer, lm, "cpu", **checkpoint_info.lm_gen_config
    )


class Socket:
    """aiohttp's ``WebSocketResponse`` as ServerState uses it: the client's audio messages
    (``b"\\x01"`` + payload), then the close; what the server sends is kept."""

    def __init__(self, frames: np.ndarray) -> None:
        import aiohttp

        binary = aiohttp.WSMsgType.BINARY
        self.incoming = [SimpleNamespace(type=binary, data=b"\x01" + f.tobytes()) for f in frames]
        self.sent: list[bytes] = []

    async def prepare(self, request: Any) -> None:
        pass

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)

    async def _messages(self) -> Any:
        for message in self.incoming:
            yield message

    def __aiter__(self) -> Any:
        return self._messages()


class PcmReader:
    """sphn's ``OpusStreamReader`` without Opus: the client's float32 PCM, at Mimi's float64."""

    def __init__(self, sample_rate: int) -> None:
        pass

    def append_bytes(self, payload: bytes) -> np.ndarray:
        return np.frombuffer(payload, np.float32).astype(np.float64)


class PcmWriter:
    """sphn's ``OpusStreamWriter`` without Opus: each decoded frame's PCM as it is."""

    def __init__(self, sample_rate: int) -> None:
        pass

    def append_pcm(self, pcm: np.ndarray) -> bytes:
        return np.ascontiguousarray(pcm, np.float64).tobytes()


def serve_as_hibiki_zero(state: Any, inputs: list[np.ndarray], monkeypatch) -> list[tuple]:  # type: ignore[no-untyped-def]
    """Each input a WebSocket session of ``state``, one after another as its lock has them:
    per session the tokens of every answered frame, the audio and the text it sent."""
    import torch
    from hibiki_zero import inference
    from moshi.utils.compile import no_compile

    monkeypatch.setattr(
        inference, "sphn", SimpleNamespace(OpusStreamReader=PcmReader, OpusStreamWriter=PcmWriter)
    )
    captured: list[Any] = []
    step = state.lm_gen.step
    monkeypatch.setattr(state.lm_gen, "step", lambda codes: captured.append(step(codes)) or captured[-1])
    sessions = []

    async def serve() -> None:
        for frames in inputs:
            socket = Socket(frames)
            monkeypatch.setattr(inference, "web", SimpleNamespace(WebSocketResponse=lambda s=socket: s))
            captured.clear()
            assert await state.handle_chat(None) is socket
            tokens = np.stack([t[0, :, 0].numpy() for t in captured if t is not None])
            assert socket.sent[0] == b"\x00"  # the handshake
            audio: list[np.ndarray] = []
            text: dict[int, str] = {}
            for message in socket.sent[1:]:
                if message[0] == 1:
                    audio.append(np.frombuffer(message[1:], np.float64))
                else:
                    assert message[0] == 2 and len(audio) - 1 not in text
                    text[len(audio) - 1] = message[1:].decode()
            sessions.append((tokens, np.stack(audio), text))

    # serve() runs its server under torch.no_grad(); no torch.compile on the CPU, as the engine
    with torch.no_grad(), no_compile():
        asyncio.run(serve())
    return sessions


def serve_batched(engine: MoshiEngine, sessions: list, inputs: list[np.ndarray]) -> list[tuple]:
    """``sessions`` through the engine's batch (``run_sessions``): per session the tokens of
    every frame past the delay, its audio out (a frame per input frame) and its text, by frame."""
    text: list[dict[int, str]] = [{} for _ in sessions]
    audio, tokens, _ = run_sessions(engine, sessions, inputs, text)
    return list(zip(tokens, audio, text, strict=True))


#: Intel MKL's conditional numerical reproducibility, for exact tokens: with its AVX-512 code
#: paths a float64 GEMM of 4 rows and one of 1 round apart in the last bit, and greedy
#: sampling of random weights then flips a near tie (seen on an AVX-512 Xeon: session 0 left
#: the package's tokens at its 8th frame). MKL reads it once, when it loads.
EXACT_BLAS = {"MKL_CBWR": "COMPATIBLE"}


def test_tiny_zero_serves_as_hibiki_zero_server_state(tmp_path, tokenizer, monkeypatch):
    if any(os.environ.get(k) != v for k, v in EXACT_BLAS.items()):  # in a process of its own
        test = f"{__file__}::test_tiny_zero_serves_as_hibiki_zero_server_state"
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
            env={**os.environ, **EXACT_BLAS}, capture_output=True, text=True, timeout=280,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-6000:]
        return
    from duplexserve.engine_bridge.moshi.lean_depformer import LeanStepAttention
    from duplexserve.engine_bridge.moshi.live_lm import LiveAttention

    config = write_checkpoint(tmp_path, "tiny-zero", tokenizer)
    config["lm_gen_config"] = {**config["lm_gen_config"], **GREEDY}
    (tmp_path / "config.json").write_text(json.dumps(config))
    inputs = [signal(30 + i, n) for i, (_, _, n, _) in enumerate(SESSIONS)]

    state = hibiki_zero_server(tmp_path, monkeypatch)
    assert state.lm_gen.lm_model.condition_provider is not None and state.lm_gen.condition_tensors
    assert (state.lm_gen.temp, state.lm_gen.temp_text) == (0.0, 0.0)
    reference = serve_as_hibiki_zero(state, inputs, monkeypatch)

    # The checkpoint's lm_gen_config decides the sampling here too (no --moshi-greedy).
    engine = MoshiEngine(4, weights=str(tmp_path), sampling=Sampling(), threads=1, dtype="float64")
    engine.start()
    try:
        lm = engine.lm_gen.lm_model
        assert isinstance(lm.transformer.layers[0].self_attn, LiveAttention)  # the fast paths
        assert isinstance(lm.depformer.layers[0].self_attn, LeanStepAttention)
        assert (engine.lm_gen.temp, engine.lm_gen.temp_text) == (0.0, 0.0)
        served = serve_batched(engine, SESSIONS, inputs)
        delay = engine.delay_frames
    finally:
        engine.stop()

    models = moshi_models(tmp_path)  # moshi.server's loop on the same files, for the record
    for i, ((tokens, audio, text), (ref_tokens, ref_audio, ref_text)) in enumerate(
        zip(served, reference, strict=True)
    ):
        n = SESSIONS[i][2]
        assert ref_tokens.shape == (n - delay, 17) and ref_audio.shape == (n - delay, FRAME)
        np.testing.assert_array_equal(tokens, ref_tokens, err_msg=f"session {i}")
        np.testing.assert_allclose(audio[delay:], ref_audio, rtol=0, atol=1e-6, err_msg=f"session {i}")
        assert not audio[:delay].any()  # the package sends nothing for the delay; the engine silence
        assert text == ref_text, i
        np.testing.assert_array_equal(server_loop(models, inputs[i])[1], ref_tokens)
    assert any(reference[i][2] for i in range(len(SESSIONS)))  # some text was sent
