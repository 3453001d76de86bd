"""PersonaPlex with its tokenizer: nothing of one call reaches the next, nor a neighbour.

A PersonaPlex-shaped checkpoint (tests/personaplex_checkpoint.py's weights) with a real
SentencePiece tokenizer whose piece count is the LM's ``text_card``, as the released
model's is, behind the real server, greedy and float64: a session's answer (audio and
text) is a function of its prompt and its input alone. So the same session must answer
the same on a fresh server, after other calls in its slot, on any row, beside any
neighbour, with the prompt cache on or off, and on every protocol that takes a prompt.
Each test here failed before the engine's reset became total (slot_state.py): a
prompted row read LMGen's token cache around the prompt's end where the last call left
it, or -2 ("not generated") on a row never used, which the text path handed to the
tokenizer and the engine restarted on.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import ServerProcess, start_server
from tests.personaplex_checkpoint import CONTEXT, PRESET
from tests.test_moshi_equivalence import signal
from tests.test_moshi_protocol import voice
from tests.test_personas import KEY, moshi_chat, native, realtime
from tests.twilio_client import FakeTwilio

pytest.importorskip("moshi")

TEXT_CARD = 64  # tiny-personaplex's, as the released model's tokenizer has its 32,000
#: Text, the agent's 4 codebooks, the user's 4: acoustic codebooks two frames late, as Hibiki's
#: (the released PersonaPlex's are one frame late, like Moshi 7B's). A prompt's row then reads
#: LMGen's token cache on either side of the prompt's last position before a step writes it.
DELAYS = [0, 0, 2, 2, 2, 0, 2, 2, 2]
PIRATE = {"text_prompt": "You are a pirate."}
PERSONA = {"text_prompt": "Help desk.", "voice_prompt": "voice.pt"}
VOICE = {"voice_prompt": "voice.wav"}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def checkpoint(personaplex_checkpoint, tmp_path_factory) -> Path:
    """The tiny PersonaPlex with its acoustic codebooks two frames late (``DELAYS``), and the
    toy tokenizer of exactly ``TEXT_CARD`` pieces: the checkpoint's own files, its config.json
    giving the delays (the preset supplies the rest, as for the released stub)."""
    import sentencepiece

    folder = tmp_path_factory.mktemp("pp-delay2")
    for item in personaplex_checkpoint.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = {"model_type": "personaplex", "version": "7b-v1", "delays": DELAYS}
    (folder / "config.json").write_text(json.dumps(config))
    path = folder / "tokenizer_spm_32k_3.model"
    assert sentencepiece.SentencePieceProcessor(str(path)).get_piece_size() == TEXT_CARD
    return folder


def serve(
    folder: Path, checkpoint: Path, slots: int, *more: str, env: dict[str, str] | None = None
) -> ServerProcess:
    folder.mkdir(exist_ok=True)
    return start_server(
        str(folder), "--engine", "moshi", "--moshi-preset", PRESET, "--moshi-weights", str(checkpoint),
        "--voice-prompt-dir", str(checkpoint / "voices"), "--moshi-context", str(CONTEXT),
        "--moshi-greedy", "--moshi-dtype", "float64", "--moshi-threads", "1", "--max-sessions", str(slots),
        "--api-keys", KEY, "--realtime-speech-dbfs", "-300", "--log-level", "info", "--model", "personaplex",
        *more,
        env=env, timeout=180,
    )  # fmt: skip


def answer(server: ServerProcess, prompt: dict[str, str]) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """One native session of ``prompt``: its audio and its text events (frame, text)."""
    events, audio, code = run(native(server, prompt))
    return checked(events, audio, code)


def checked(events: list[dict[str, Any]], audio: np.ndarray, code: int | None):
    assert code == 1000 and events[-1]["reason"] == "completed", events[-3:]
    return audio, [(e["frame"], e["text"]) for e in events if e["type"] == "text.delta"]


def together(server: ServerProcess, prompts: list[dict[str, str]], stagger_s: float = 0.0) -> list[Any]:
    """Sessions of ``prompts`` live at once (each opened ``stagger_s`` after the one before)."""

    async def one(i: int, prompt: dict[str, str]) -> Any:
        await asyncio.sleep(i * stagger_s)
        return checked(*await native(server, prompt))

    async def main() -> list[Any]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    return run(main())


def pieces(checkpoint: Path) -> set[str]:
    """Every piece of the checkpoint's tokenizer, as a text event carries it."""
    import sentencepiece

    tokenizer = sentencepiece.SentencePieceProcessor(str(checkpoint / "tokenizer_spm_32k_3.model"))
    return {tokenizer.id_to_piece(i).replace("\u2581", " ") for i in range(tokenizer.get_piece_size())}


def same(got: tuple[np.ndarray, list], want: tuple[np.ndarray, list], what: str) -> None:
    np.testing.assert_array_equal(got[0], want[0], err_msg=what)
    assert got[1] == want[1], f"{what}: text {got[1]} != {want[1]}"


def test_every_session_answers_as_a_fresh_servers_first_whatever_came_before(checkpoint, tmp_path):
    """One slot, prompt cache on: the same session after others in its slot, and each kind of
    prompt (text, voice, both, none) after the others, equal to a fresh row's first."""
    one = serve(tmp_path / "one", checkpoint, 1)
    three = serve(tmp_path / "three", checkpoint, 3, "--prompt-cache-mb", "0")
    try:
        first = answer(one, PERSONA)  # a fresh server's first session
        assert "engine restart" not in one.log() and "could not be rendered" not in one.log()
        assert first[1], "no text event: the text path was not exercised"
        assert all(text in pieces(checkpoint) for _, text in first[1]), first[1]
        # Three at once on a fresh server with the cache off: each on a row never used.
        fresh = dict(zip(("pirate", "voice", "none"), together(three, [PIRATE, VOICE, {}]), strict=True))
        assert not np.array_equal(fresh["pirate"][0], first[0])
        # The one slot, reused by every kind of prompt in turn.
        for name, prompt in (("pirate", PIRATE), ("persona", PERSONA), ("voice", VOICE), ("none", {}),
                             ("persona", PERSONA), ("persona", PERSONA)):  # fmt: skip
            same(answer(one, prompt), first if name == "persona" else fresh[name], f"{name} in a reused slot")
        # Three of the same prompt at once, then one among neighbours that join and leave.
        for i, got in enumerate(together(three, [PERSONA] * 3)):
            same(got, first, f"persona on row {i} of three at once")
        got = together(three, [PIRATE, PERSONA, {}], stagger_s=0.3)
        same(got[1], first, "persona beside neighbours")
        same(got[0], fresh["pirate"], "pirate beside neighbours")
        same(got[2], fresh["none"], "no prompt beside neighbours")
        assert "engine restart" not in one.log() + three.log()
    finally:
        one.stop()
        three.stop()


# --------------------------------------------------------------- the other protocols with prompts
def test_realtime_moshi_chat_and_twilio_sessions_in_a_row_answer_alike(checkpoint, tmp_path):
    """Each protocol's way of carrying a prompt: the prompt, another, the first again in one
    slot; the third answers as the first, audio and text."""
    server = serve(tmp_path, checkpoint, 1)
    try:
        persona = {"instructions": PERSONA["text_prompt"], "audio": {"output": {"voice": "voice.pt"}}}
        rt = [run(realtime(server, session)) for session in (persona, {"instructions": "hello"}, persona)]
        pcm = voice(10)
        chat = [run(moshi_chat(server, query, pcm)) for query in (PERSONA, PIRATE, PERSONA)]
        mulaw = (np.clip(signal(5, 10).reshape(-1)[::3], -1, 1) * 100 + 128).astype(np.uint8).tobytes()
        calls = [run(_twilio_call(server, custom, mulaw)) for custom in (PERSONA, PIRATE, PERSONA)]
        assert "engine restart" not in server.log()
    finally:
        server.stop()
    (events, audio), _, (again_events, again) = rt
    assert audio == again and transcript(events) and transcript(again_events) == transcript(events)
    assert all(text in pieces(checkpoint) for text in transcript(events))
    first, _, again = chat
    assert first.errors == again.errors == [] and first.text and again.text == first.text
    n = len(pcm) - 1920
    np.testing.assert_array_equal(again.pcm[:n], first.pcm[:n])
    assert len(calls[0]) == len(mulaw) - 640 and calls[2] == calls[0]


def transcript(events: list[dict[str, Any]]) -> list[str]:
    return [e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"]


async def _twilio_call(server: ServerProcess, custom: dict[str, str], mulaw: bytes) -> bytes:
    twilio = FakeTwilio(server.ws("/v1/twilio"), custom={"token": KEY, **custom})
    await twilio.open()
    await twilio.send_audio(mulaw)
    await twilio.wait_audio(len(mulaw) - 640)
    await twilio.stop()
    await twilio.wait_closed()
    return bytes(twilio.received.audio[: len(mulaw) - 640])


@pytest.mark.parametrize("where", ["piece", "deliver"])
def test_an_output_that_fails_to_render_ends_its_session_alone(checkpoint, tmp_path, where):
    """The 6th text piece the engine renders, or the 6th answer the loop hands a session,
    raises (tests/faults/sitecustomize.py): that session ends with internal_error and its
    counts, logged once and counted; the step, the engine and the other session go on."""
    tests = Path(__file__).parent  # the tree under test first: sitecustomize imports from it
    env = {"PYTHONPATH": os.pathsep.join((str(tests / "faults"), str(tests.parent))),
           "DUPLEXSERVE_TEST_FAULT": f"{where}:6"}  # fmt: skip
    server = serve(tmp_path, checkpoint, 2, env=env)
    try:
        results = run(_two(server))
        alone = answer(server, PIRATE), answer(server, PERSONA)
        metrics, log = server.metrics(), server.log()
    finally:
        server.stop()
    failed = [i for i, (events, _, code) in enumerate(results) if code != 1000]
    assert len(failed) == 1, [r[2] for r in results]
    events, audio, code = results[failed[0]]
    error = next(e for e in events if e["type"] == "error")
    assert code == 1011 and error["code"] == "internal_error" and error["fatal"]
    closed = events[-1]
    assert closed["type"] == "session.closed" and closed["reason"] == "internal_error"
    assert closed["frames_out"] == len(audio) and closed["frames_in"] >= closed["frames_out"]
    survivor = 1 - failed[0]
    same(checked(*results[survivor]), alone[survivor], "the other session")
    assert "engine restart" not in log
    assert log.count("RuntimeError: fault put in by the test") == 1  # logged once
    stage = "engine" if where == "piece" else "loop"
    assert metrics[f'duplexserve_output_failures_total{{stage="{stage}"}}'] == 1


async def _two(server: ServerProcess) -> list[Any]:
    return list(await asyncio.gather(native(server, PIRATE), native(server, PERSONA)))
