"""vLLM-Omni's real duplex engine on a CPU, with the model stood in (tests, benchmarks).

Everything of vLLM-Omni 0.30 runs as shipped: ``DuplexOmniEngine`` with its janus
request queue (256) and correlated RPC, the ``orchestrator`` thread and its loop,
``DuplexOrchestrator`` with its ``DuplexSessionManager``, one ``DuplexSessionRunner``
per session with its mailbox, its append tasks and its thread-pool offloads, the
realtime projection of every event, and PersonaPlex's real 24 kHz PCM append buffer.
What is stood in is what needs a GPU:

- no model or deploy-config resolution and no stage process: one stage whose pool
  has no replica (the orchestration loop idles on its own 1 ms poll, as shipped);
- the orchestrator's stage port ``submit()`` keeps the orchestrator's request
  bookkeeping and, instead of handing the request to a stage pool, queues it for
  an echo "model step" that answers every append of that loop turn with one stage
  output each (its 1920 samples are the appended frame) through the real
  ``_route_output`` path, as an engine core's step would;
- a small plugin with PersonaPlex's frame contract (24 kHz ``pcm_f32le``, 80 ms
  units, resumable Stage 0, model-native turns) and an echo data plane.

This is the set-up of the public report behind this project ("a real vllm-omni
full-duplex orchestrator", model work mocked away) and of vLLM-Omni's own CPU tests.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm_omni.config.stage_config import DuplexSessionRuntimeConfig
from vllm_omni.engine.duplex.config import DuplexCapabilities, DuplexSessionConfig
from vllm_omni.engine.duplex.contracts import (
    DuplexAppendPlan,
    DuplexFence,
    DuplexStageSubmission,
    DuplexStageSubmissionResult,
    duplex_resource_request_belongs_to_session,
)
from vllm_omni.engine.duplex.intermediate import build_duplex_append_prompt
from vllm_omni.engine.duplex.plugin import (
    DefaultDuplexModelSessionState,
    DuplexDataPlane,
    DuplexModelPlugin,
    EncodeAudio,
)
from vllm_omni.engine.duplex_omni_engine import DuplexOmniEngine
from vllm_omni.engine.duplex_orchestrator import DuplexOrchestrator, DuplexOrchestratorRequestState
from vllm_omni.engine.orchestrator import OrchestratorBase, StreamingSegmentState
from vllm_omni.engine.stage_runtime import StageRuntimeInfo
from vllm_omni.outputs import OmniRequestOutput

from duplexserve.testing import STANDIN_MODEL

SAMPLE_RATE = 24000
FRAME_SAMPLES = 1920


def _personaplex_input() -> Any:
    """PersonaPlex's real PCM append buffer module, loaded on its own.

    In 0.30.0 the package ``personaplex.duplex`` fails to import (its ``__init__``
    still imports ``DuplexFence`` from ``engine.duplex.messages``, where it no longer
    is), but its ``input.py`` needs only numpy and the standard library.
    """
    root = importlib.util.find_spec("vllm_omni")
    assert root is not None and root.submodule_search_locations
    path = f"{root.submodule_search_locations[0]}/model_executor/models/personaplex/duplex/input.py"
    spec = importlib.util.spec_from_file_location("vllm_omni_personaplex_duplex_input", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PersonaPlexPcmAppendBuffer = _personaplex_input().PersonaPlexPcmAppendBuffer


# --------------------------------------------------------------------- plugin
@dataclass(frozen=True, slots=True)
class EchoContext:
    response_format: str = "pcm16"
    speed: float | None = None
    modalities: tuple[str, ...] = ("audio", "text")


class EchoDataPlane(DuplexDataPlane):
    """Turns each echo stage output into one realtime audio event (plus text every N)."""

    def __init__(self, encode_audio: EncodeAudio, text_every: int) -> None:
        self._encode_audio = encode_audio
        self._text_every = text_every
        self._terminal: set[str] = set()

    def begin_request(self, request_id: str) -> None:
        self._terminal.discard(request_id)

    def is_terminal(self, request_id: str | None) -> bool:
        return request_id is not None and request_id in self._terminal

    def mark_terminal(self, request_id: str) -> None:
        self._terminal.add(request_id)

    def close_stream(self, request_id: str) -> None:
        self._terminal.discard(request_id)

    def close_session(self, session_id: str, *, active_request_id: str | None = None) -> None:
        self._terminal = {
            r
            for r in self._terminal
            if r != active_request_id and not duplex_resource_request_belongs_to_session(r, session_id)
        }

    def project(self, result: object, *, context: object | None = None) -> Iterator[dict[str, object]]:
        outputs = result.get("data_plane_outputs") if isinstance(result, dict) else None
        if not isinstance(outputs, list):
            return
        ctx = context if isinstance(context, EchoContext) else EchoContext()
        for output in outputs:
            mm = getattr(output, "multimodal_output", None) or {}
            audio = mm.get("audio")
            if audio is None:
                continue
            seq = int(mm.get("seq", 0))
            text = f"w{seq}" if self._text_every and seq % self._text_every == 0 else ""
            yield {
                "stage_role": "tts",
                "is_listen": False,
                "data_plane_request_id": getattr(output, "request_id", None),
                "text": text,
                "audio_data": self._encode_audio(audio, SAMPLE_RATE, ctx.response_format, ctx.speed) or "",
                "audio_format": ctx.response_format,
                "sample_rate_hz": SAMPLE_RATE,
                "audio_duration_ms": 80,
                "end_of_turn": False,
            }


def standin_capabilities(max_sessions: int) -> DuplexCapabilities:
    """PersonaPlex's contract: 80 ms units into one resumable Stage-0 request, model-native turns."""
    return DuplexCapabilities(
        supports_model_native_turn_policy=True,
        supports_external_turn_signal=False,
        supports_barge_in=False,
        supports_input_append=True,
        supports_replace_latest_chunk=False,
        supports_reencode_context=False,
        supports_turn_commit_only=False,
        supports_model_internal_state=True,
        supports_stage_resumption=True,
        supports_core_resumable_request=True,
        supports_independent_io_streams=True,
        supports_realtime_endpoint=True,
        supports_multi_session=max_sessions > 1,
        supports_multi_session_same_replica=True,
        supports_session_lease=True,
        supports_session_resume=True,
        session_admission_mode="engine_managed",
        requires_model_runner_kv=True,
        adapter_patterns=["scheduler_data_plane"],
        signal_sources=["model_native", "client_event"],
        stage_handoff_transport="scheduler_data_plane",
        chunk_period_ms=80,
        target_barge_in_latency_ms=None,
    )


class StandInPlugin(DuplexModelPlugin):
    """A frame-locked echo model: each 80 ms unit in is answered by the same 80 ms out."""

    plugin_id = "duplexserve_standin_echo"
    silence_continuation_samples = FRAME_SAMPLES

    def __init__(self, encode_audio: EncodeAudio, *, text_every: int = 5) -> None:
        super().__init__(encode_audio)
        self.data_plane = EchoDataPlane(encode_audio, text_every)

    def configure_sampling_params(
        self, *, runtime_config: dict[str, object], defaults: tuple[object, ...]
    ) -> tuple[object, ...]:
        del runtime_config
        return defaults

    def plan_append(
        self,
        *,
        request_id: str,
        fence: DuplexFence,
        session_config: dict[str, object],
        runtime_config: dict[str, object],
        seq: int,
        turn_seq: int,
        payload: object,
        final: bool,
        sampling_params: object,
    ) -> DuplexAppendPlan:
        del sampling_params
        return DuplexAppendPlan(
            prompt=build_duplex_append_prompt(
                request_id=request_id,
                fence=fence,
                session_config=session_config,
                runtime_config=runtime_config,
                seq=seq,
                turn_seq=turn_seq,
                payload=payload,
                final=final,
                prompt_token_ids=[0],
                model_fields={"source_input_seq": seq},
            )
        )

    def decide_output(self, **kwargs: Any) -> None:
        return None  # one stage: every output is final

    def create_session_state(self) -> DefaultDuplexModelSessionState:
        return DefaultDuplexModelSessionState(audio_buffer=PersonaPlexPcmAppendBuffer())

    def capabilities(self, *, max_sessions: int) -> DuplexCapabilities:
        return standin_capabilities(max_sessions)

    def validate_client_extra_body(self, extra_body: object) -> None:
        return None

    async def prepare_runtime_config(
        self, config: DuplexSessionConfig, *, model_config: object | None
    ) -> dict[str, object]:
        return {}

    def runtime_config_for_update(
        self, config: DuplexSessionConfig, current: Mapping[str, object]
    ) -> dict[str, object]:
        return dict(current)

    def data_plane_context(
        self, *, response_format: str, speed: float | None, modalities: tuple[str, ...], **kwargs: Any
    ) -> EchoContext:
        return EchoContext(response_format=response_format, speed=speed, modalities=modalities)


# ----------------------------------------------------------- orchestrator side
class CountingExecutor(ThreadPoolExecutor):
    """A thread pool that counts its submissions (the executor hops a benchmark reports)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.submissions = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.submissions += 1  # from one loop thread at a time; a benchmark count, not a lock
        return super().submit(fn, *args, **kwargs)


class StandInOrchestrator(DuplexOrchestrator):
    """``DuplexOrchestrator`` whose stage port answers appends with an echo step."""

    def __init__(self, *args: Any, step_ms: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The session runners' shared pool (4 workers, as shipped), counted.
        shipped = self.session_manager.executor
        self.session_manager.executor = CountingExecutor(max_workers=4, thread_name_prefix="duplex-session")
        shipped.shutdown(wait=False)
        self._step_ms = step_ms
        self._pending: list[tuple[str, dict[str, object]]] = []
        self._step_scheduled = False

    async def submit(self, submission: DuplexStageSubmission) -> DuplexStageSubmissionResult:
        context = submission.context
        state = self.request_states.get(context.request_id)
        if not isinstance(state, DuplexOrchestratorRequestState):
            raise RuntimeError(f"duplex request was not preregistered: {context.request_id}")
        state.streaming.enabled = submission.resumable
        now = time.time()
        state.stage_fences[context.stage_id] = context.fence
        state.stage_submit_ts[context.stage_id] = now
        state.request_timestamp = now
        self._register_running_request(state)
        self._pending.append((context.request_id, dict(submission.prompt)))
        if not self._step_scheduled:
            self._step_scheduled = True
            asyncio.get_running_loop().create_task(self._model_step())
        return DuplexStageSubmissionResult(
            request_id=context.request_id, stage_id=context.stage_id, replica_id=0
        )

    async def _model_step(self) -> None:
        """One engine-core step: every append queued so far gets its output, in order."""
        await asyncio.sleep(self._step_ms / 1000.0)
        batch, self._pending = self._pending, []
        self._step_scheduled = False
        for request_id, prompt in batch:
            state = self.request_states.get(request_id)
            if state is None:
                continue  # cleaned up while the step ran
            duplex = prompt["model_intermediate_buffer"]["duplex"]  # type: ignore[index]
            payload = duplex["payload"]
            audio = np.frombuffer(base64.b64decode(payload["audio"]), dtype="<f4")
            output = OmniRequestOutput(
                request_id=request_id,
                finished=False,
                final_output_type="audio",
                _multimodal_output={"audio": audio, "sr": SAMPLE_RATE, "seq": duplex["seq"]},
            )
            state.streaming.segments[0] = StreamingSegmentState(
                finished=True, token_ids=[0], output_metadata={}
            )
            await self._route_output(0, 0, output, state, None)


class _StubPool:
    """A stage pool with no replica: the orchestration loop polls nothing."""

    stage_id = 0
    stage_type = "llm"
    final_output = True
    final_output_type = "audio"
    num_replicas = 0
    live_num_replicas = 0
    clients: list[Any] = []

    def __init__(self) -> None:
        params = SamplingParams(max_tokens=1)
        params.output_kind = RequestOutputKind.DELTA
        self.stage_client = SimpleNamespace(default_sampling_params=params, custom_process_input_func=None)
        self.stage_vllm_config = SimpleNamespace(model_config=None)

    def available_replica_ids(self) -> list[int]:
        return []

    def live_replica_ids(self) -> list[int]:
        return []

    async def abort_requests(self, request_ids: list[str]) -> list[Any]:
        return []  # nothing runs on a stage: the echo step drops outputs of cleaned-up requests

    def release_bindings(self, request_ids: list[str]) -> None:
        return None

    def get_bound_replica_id(self, request_id: str) -> int:
        return 0


class StandInDuplexOmniEngine(DuplexOmniEngine):
    """``DuplexOmniEngine`` with resolution and stage launch skipped (see module docstring)."""

    def __init__(
        self,
        *,
        duplex_audio_encoder: EncodeAudio,
        max_sessions: int = 256,
        text_every: int = 5,
        step_ms: float = 0.0,
        idle_ttl_s: float | None = 300.0,
        **kwargs: Any,
    ) -> None:
        self._standin = {
            "max_sessions": max_sessions,
            "text_every": text_every,
            "step_ms": step_ms,
            "idle_ttl_s": idle_ttl_s,
        }
        super().__init__(STANDIN_MODEL, duplex_audio_encoder=duplex_audio_encoder, **kwargs)

    def _validate_deployment(self) -> None:
        self.deploy_config = SimpleNamespace(session_mode="duplex")
        self.duplex_session_config = DuplexSessionRuntimeConfig(
            max_sessions=self._standin["max_sessions"], idle_ttl_s=self._standin["idle_ttl_s"]
        )
        self.plugin = StandInPlugin(self._audio_encoder, text_every=self._standin["text_every"])

    def _resolve_stage_configs(self, model: str, kwargs: dict[str, Any], *, trust_remote_code: Any) -> Any:
        return None, [SimpleNamespace(stage_id=0)]

    def _set_pipeline_runtime_config(self, pipeline_config: Any, config_path: Any) -> None:
        self.endpoint_restrictions = ()
        self._event_driven_orch_default = False

    def _initialize_stages(self, stage_init_timeout: int) -> None:
        pool = _StubPool()
        self._runtime = SimpleNamespace(create_membership_controller=lambda: None, shutdown=lambda: None)
        self.stage_pools = [pool]  # type: ignore[list-item]
        self.stage_clients = [pool.stage_client]
        self.stage_vllm_configs = [None]
        self.default_sampling_params_list = [pool.stage_client.default_sampling_params]
        self.stage_metadata = [
            StageRuntimeInfo(final_output=True, final_output_type="audio", stage_type="llm", model_stage=None)
        ]

    @property
    def engine_executor_submissions(self) -> int:
        """Thread-pool hops inside vLLM-Omni's session runners (its conversion and VAD offloads)."""
        orchestrator = getattr(self, "orchestrator", None)
        return orchestrator.session_manager.executor.submissions if orchestrator is not None else 0

    def _detect_pd_config(self) -> None:
        return None

    def _create_orchestrator(self, **orchestrator_kwargs: Any) -> OrchestratorBase:
        assert self.plugin is not None
        #: The orchestrator thread's loop, for tests that must hold it still.
        self.orchestrator_loop = asyncio.get_running_loop()
        self.orchestrator = StandInOrchestrator(
            plugin=self.plugin,
            duplex_session_config=self.duplex_session_config,
            model_config=None,
            step_ms=self._standin["step_ms"],
            **orchestrator_kwargs,
        )
        return self.orchestrator

