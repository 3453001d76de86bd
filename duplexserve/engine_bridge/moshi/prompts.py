"""PersonaPlex's prompt, run as one prefill instead of a step a frame.

NVIDIA's server steps every session through a prompt before its handshake: the voice
prompt (a ``.wav`` encoded by Mimi, or a ``.pt`` of per-step input embeddings and the
token cache they leave), 6 frames of silence, the text prompt's tokens
(``"<system> ... <system>"``, one a frame), 6 frames of silence. Every stream of every
frame is forced (text PAD outside the text phase, the agent's audio the voice or
silence, the user's audio a 440 Hz tone), and what the model samples meanwhile is
thrown away. So the prompt leaves exactly three things behind, all known in advance: the
transformer's KV for the prompt's positions, LMGen's token cache around the last one,
and the forced tokens of the first conversation steps. ``Prompt`` computes those, and
the engine runs all the prompt's positions through the transformer in one forward
(``live_lm``'s prefill), so a session is ready after one forward, not after a step a
frame.

NVIDIA's ``LMGen`` counts one call later than Kyutai's (its first call runs no model,
and call ``o`` runs the model on position ``o - 1``): the token streams are the same,
but a user frame reaches the model one call after it arrives. The engine (Kyutai's
``LMGen``) gets the same positions by holding each user frame back one step
(``held_codes``); the first frame held is the prompt's last tone frame.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Mimi's codes of 80 ms of silence and of the 440 Hz tone, NVIDIA's constants for its
# 8 codebooks of 2048; another codec (the tiny presets') encodes the same two frames.
SILENCE_TOKENS = (948, 243, 1178, 546, 1736, 1030, 1978, 2008)
SINE_TOKENS = (430, 1268, 381, 1611, 1095, 1495, 56, 472)
SILENCE_FRAMES = 6  # int(0.5 s * 12.5 Hz), before and after the text
TEXT_PAD = 3  # the text stream outside the text phase
VOICE_LUFS = -24.0
VOICE_SUFFIXES = (".pt", ".wav", ".flac", ".mp3", ".ogg")


def wrap_system(text: str) -> str:
    """The text as NVIDIA's server wraps it, unless it is wrapped already."""
    cleaned = text.strip()
    if cleaned.startswith("<system>") and cleaned.endswith("<system>"):
        return cleaned
    return f"<system> {cleaned} <system>"


def sine_frame(samples: int = 1920, rate: int = 24000) -> np.ndarray:
    t = np.linspace(0.0, samples / rate, samples, endpoint=False)
    return (0.5 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)


def encode_frames(mimi: Any, pcm: np.ndarray) -> np.ndarray:
    """``pcm`` (float, 24 kHz) cut into 80 ms frames (the last padded with zeros), each
    encoded in turn by a fresh streaming Mimi of one row, as NVIDIA encodes a voice:
    the codes ``[frames, codebooks]``."""
    import torch

    frame = 1920
    frames = max(1, -(-len(pcm) // frame))
    padded = np.zeros(frames * frame, np.float64)
    padded[: len(pcm)] = pcm
    param = next(mimi.parameters())
    codes = []
    with torch.no_grad(), mimi.streaming(1):
        for i in range(frames):
            x = torch.from_numpy(padded[i * frame : (i + 1) * frame]).to(param.device, param.dtype)
            codes.append(mimi.encode(x.view(1, 1, -1))[0, :, 0].cpu().numpy())
    return np.stack(codes)


@dataclass(frozen=True)
class Voice:
    """A voice prompt, loaded once and shared by every session that asks for it: the
    agent's codes of each frame (an audio file), or the input embeddings of each model
    call and the token cache after them (a ``.pt``, NVIDIA's ``voices.tgz`` format)."""

    name: str
    codes: np.ndarray | None = None  # [frames, codebooks]
    embeddings: Any = None  # torch [frames - 1, dim]: NVIDIA's first call runs no model
    cache: Any = None  # torch [streams, ring]: LMGen's token cache after the voice

    @property
    def frames(self) -> int:
        return len(self.codes) if self.codes is not None else len(self.embeddings) + 1


def load_voice(path: Path, mimi: Any, dim: int, streams: int) -> Voice:
    """A voice file as NVIDIA's server reads it; ``ValueError`` for one that does not fit
    this model (``dim``: the LM's width, ``streams``: its token streams)."""
    import torch

    if path.suffix == ".pt":
        state = torch.load(path, map_location="cpu", weights_only=True)
        embeddings, cache = state["embeddings"], state["cache"]
        if embeddings.shape[-1] != dim or cache.shape[-2] != streams or len(embeddings) < 1:
            raise ValueError(
                f"voice {path.name}: embeddings {tuple(embeddings.shape)} and cache {tuple(cache.shape)} "
                f"do not fit this model (width {dim}, {streams} token streams)"
            )
        embeddings = embeddings.reshape(len(embeddings), dim)
        return Voice(path.name, embeddings=embeddings, cache=cache.reshape(streams, -1))
    pcm = read_recording(str(path)).astype(np.float64)
    return Voice(path.name, codes=encode_frames(mimi, normalize_loudness(pcm, 24000, VOICE_LUFS)))


def read_recording(path: str) -> np.ndarray:
    """An audio file in any format and rate sphn reads, its first channel at Mimi's 24 kHz."""
    import sphn

    pcm, rate = sphn.read(path)
    return sphn.resample(pcm, src_sample_rate=rate, dst_sample_rate=24000)[0]


def normalize_loudness(pcm: np.ndarray, rate: int, target_lufs: float) -> np.ndarray:
    """ITU-R BS.1770 integrated loudness brought to ``target_lufs``, with pyloudnorm as
    NVIDIA's server does it."""
    try:
        import pyloudnorm
    except ImportError:
        raise ValueError(
            "an audio voice prompt is normalised with pyloudnorm, which is not installed "
            "(pip install pyloudnorm), or use a .pt voice"
        ) from None
    loudness = pyloudnorm.Meter(rate).integrated_loudness(pcm)
    return pyloudnorm.normalize.loudness(pcm, loudness, target_lufs)


def load_voices(folder: str, mimi: Any, dim: int, streams: int) -> dict[str, Voice]:
    """Every voice file in ``folder`` by its name (``NATF2.pt``)."""
    if not folder:
        return {}
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"--voice-prompt-dir {root} is not a folder")
    return {
        p.name: load_voice(p, mimi, dim, streams)
        for p in sorted(root.iterdir())
        if p.suffix in VOICE_SUFFIXES and p.is_file()
    }


@dataclass(frozen=True)
class StreamLayout:
    """What a prompt needs of the model: its streams' delays and initial tokens, and the
    two forced audio frames in its codec."""

    delays: tuple[int, ...]  # per stream: text, the agent's codebooks, the user's
    initial: tuple[int, ...]  # LMGen's initial token per stream
    codebooks: int  # per audio stream
    silence: tuple[int, ...]
    sine: tuple[int, ...]

    @classmethod
    def of(cls, lm: Any, mimi: Any) -> StreamLayout:
        import torch

        k = mimi.num_codebooks
        if k == len(SILENCE_TOKENS) and mimi.cardinality == 2048:
            silence, sine = SILENCE_TOKENS, SINE_TOKENS
        else:
            zeros = np.zeros(1920, np.float64)
            silence = tuple(int(x) for x in encode_frames(mimi, zeros)[0])
            sine = tuple(int(x) for x in encode_frames(mimi, sine_frame().astype(np.float64))[0])
        initial = lm._get_initial_token().view(-1)
        assert initial.dtype == torch.long
        return cls(tuple(lm.delays), tuple(initial.tolist()), k, silence, sine)


def prompt_frames(text_tokens: int, voice: Voice | None) -> int:
    """The frames of a prompt (``Prompt.frames``) of ``text_tokens`` tokens and ``voice``,
    known before it is built: checked against the context first, building one is not free."""
    return (voice.frames if voice is not None else 0) + 2 * SILENCE_FRAMES + text_tokens


@dataclass(frozen=True)
class Prompt:
    """One session's prompt, laid out as NVIDIA's LMGen leaves its token cache.

    ``tokens[p]`` holds every stream's token at position ``p`` (-1 where the prompt
    forces nothing: the model samples it). Positions ``0 .. frames - 2`` are the
    transformer's input during the prompt (``voice_embeddings`` replaces the first of them
    for a ``.pt`` voice), position ``frames - 1`` is the first conversation step's input,
    and later positions hold the agent's tokens the prompt still forces then.
    """

    frames: int
    tokens: np.ndarray  # [frames + max delay, streams] int64
    voice_embeddings: Any = None

    @classmethod
    def build(cls, layout: StreamLayout, text: list[int], voice: Voice | None) -> Prompt:
        k = layout.codebooks
        rows = []  # every stream of every prompt frame: text, agent, user
        voice_frames = voice.frames if voice is not None else 0
        codes = voice.codes if voice is not None and voice.codes is not None else None
        for i in range(voice_frames):
            rows.append((TEXT_PAD, *(codes[i] if codes is not None else (-1,) * k), *layout.sine))
        silence = (TEXT_PAD, *layout.silence, *layout.sine)
        rows += [silence] * SILENCE_FRAMES
        rows += [(t, *layout.silence, *layout.sine) for t in text]
        rows += [silence] * SILENCE_FRAMES
        frames = np.asarray(rows, dtype=np.int64)
        n, streams = frames.shape
        delays = np.asarray(layout.delays)
        tokens = np.full((n + int(delays.max()), streams), -1, dtype=np.int64)
        for s, d in enumerate(delays.tolist()):
            tokens[d : d + n, s] = frames[:, s]  # frame q writes stream s at q + delay
            tokens[: d + 1, s] = layout.initial[s]  # the first positions: LMGen's initial
        embeddings = None
        if voice is not None and voice.embeddings is not None:
            ring = voice.cache.shape[-1]
            for p in range(voice_frames - 1, voice_frames + int(delays.max())):
                from_voice = p - delays < voice_frames  # written during the voice: the .pt's cache
                tokens[p, from_voice] = voice.cache[from_voice, p % ring].numpy()
            embeddings = voice.embeddings
        return cls(n, tokens, embeddings)

    @property
    def forced_after(self) -> list[np.ndarray]:
        """Per conversation step after the prompt, the agent's tokens it still forces
        (-1: sampled): the prompt's delayed codebooks, written before it ended."""
        return [row for row in self.tokens[self.frames :]]
