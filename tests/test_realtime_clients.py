"""The Realtime clients the README names, each at its own defaults (its default model name),
against a server started as the README starts it: the ``openai`` SDK, LiveKit's realtime
plugin (livekit-plugins-openai) and pipecat's OpenAI realtime service (pipecat-ai). Each
names a model of OpenAI's (``gpt-realtime``, ``gpt-realtime-2.1``) in ``?model=``; a server
without ``--served-model-name`` serves it, and each client gets the echo engine's audio back.

The plugin and the service are driven as objects, without a LiveKit room or a pipecat
transport: 24 kHz pcm16 frames pushed in, the audio frames they emit collected.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import openai
import pytest

from tests.conftest import ServerProcess, start_server
from tests.test_realtime_protocol import chunks, tone

RATE = 24000
CHUNK = 2400  # 100 ms, as LiveKit pushes it


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Any:
    """As the README starts it: the synthetic echo engine, no model names."""
    server = start_server(str(tmp_path_factory.mktemp("clients")), "--max-sessions", "4")
    yield server
    server.stop()


def speech(seconds: float = 2.0) -> np.ndarray:
    """Loud noise, counted as speech: its echo comes back as a response's audio."""
    return np.frombuffer(tone(int(seconds * RATE) // 1920), dtype="<i2")


def loud(pcm: bytes) -> bool:
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
    return samples.size > 0 and float(np.sqrt(np.mean(samples**2))) > 1000


def test_openai_sdk_at_its_model_name(server: ServerProcess) -> None:
    async def go() -> tuple[str, bytes]:
        client = openai.AsyncOpenAI(base_url=server.http + "/v1", api_key="unused")
        async with client.realtime.connect(model="gpt-realtime") as conn:
            created = await asyncio.wait_for(conn.recv(), 10)
            assert created.type == "session.created"
            for piece in chunks(speech().tobytes()):
                await conn.input_audio_buffer.append(audio=piece)
            heard = b""
            while not loud(heard):
                event = await asyncio.wait_for(conn.recv(), 20)
                if event.type == "response.output_audio.delta":
                    heard += base64.b64decode(event.delta)
            return created.session.model, heard

    model, heard = asyncio.run(go())
    assert model == "gpt-realtime"  # echoed, as the client named it
    assert loud(heard)


def test_livekit_realtime_plugin_at_its_defaults(server: ServerProcess) -> None:
    rtc = pytest.importorskip("livekit.rtc")
    lk_openai = pytest.importorskip("livekit.plugins.openai")

    async def go() -> tuple[str, list[Any]]:
        model = lk_openai.realtime.RealtimeModel(base_url=server.http + "/v1", api_key="unused")
        session = model.session()
        frames: list[Any] = []
        heard = asyncio.Event()
        readers: set[asyncio.Task[None]] = set()

        async def read(generation: Any) -> None:
            async for message in generation.message_stream:
                async for frame in message.audio_stream:
                    frames.append(frame)
                    if loud(bytes(frame.data)):
                        heard.set()

        def created(generation: Any) -> None:
            task = asyncio.create_task(read(generation))
            readers.add(task)
            task.add_done_callback(readers.discard)

        session.on("generation_created", created)
        try:
            pcm = speech()
            for i in range(0, len(pcm), CHUNK):
                session.push_audio(rtc.AudioFrame(pcm[i:i + CHUNK].tobytes(), RATE, 1, CHUNK))
                await asyncio.sleep(0.02)
            await asyncio.wait_for(heard.wait(), 30)
        finally:
            await session.aclose()
            await model.aclose()
        return model.model, frames

    name, frames = asyncio.run(go())
    assert name == "gpt-realtime"  # the plugin's default, in ?model=
    assert frames and {(f.sample_rate, f.num_channels) for f in frames} == {(RATE, 1)}


def test_pipecat_realtime_service_at_its_defaults(server: ServerProcess) -> None:
    pytest.importorskip("pipecat")
    from pipecat.frames.frames import InputAudioRawFrame, TTSAudioRawFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineWorker
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
    from pipecat.workers.runner import WorkerRunner

    class Heard(FrameProcessor):
        """The pipeline's sink: the service's audio frames, as a transport would play them."""

        def __init__(self) -> None:
            super().__init__()
            self.frames: list[Any] = []
            self.loud = asyncio.Event()

        async def process_frame(self, frame: Any, direction: Any) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame):
                self.frames.append(frame)
                if loud(frame.audio):
                    self.loud.set()
            await self.push_frame(frame, direction)

    async def go() -> tuple[str, list[Any]]:
        service = OpenAIRealtimeLLMService(api_key="unused", base_url=server.ws("/v1/realtime"))
        heard = Heard()
        worker = PipelineWorker(Pipeline([service, heard]), enable_rtvi=False, idle_timeout_secs=None)
        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        running = asyncio.create_task(runner.run())
        try:
            pcm = speech()
            for i in range(0, len(pcm), CHUNK):
                chunk = pcm[i:i + CHUNK].tobytes()
                await worker.queue_frame(InputAudioRawFrame(audio=chunk, sample_rate=RATE, num_channels=1))
                await asyncio.sleep(0.02)
            await asyncio.wait_for(heard.loud.wait(), 30)
        finally:
            await worker.cancel()
            await asyncio.wait_for(running, 30)
        return service.base_url, heard.frames

    url, frames = asyncio.run(go())
    assert "?model=gpt-realtime" in url  # the service's default model, named in the URL
    assert frames and {(f.sample_rate, f.num_channels) for f in frames} == {(RATE, 1)}
