"""Building ``--engine vllm-omni`` from the server configuration (imports vLLM-Omni lazily)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from typing import Any

from duplexserve.config import ServerConfig
from duplexserve.engine_bridge.vllm_omni.bridge import VllmOmniEngine
from duplexserve.engine_bridge.vllm_omni.events import MODEL_RATE
from duplexserve.testing import STANDIN_MODEL


def session_payload(model: str, input_rate: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """The Realtime session object each session opens with (PersonaPlex's preset by default).

    Input is ``pcm_f32le`` at the model's rate, so vLLM-Omni converts nothing; output is
    its own encoder's 24 kHz ``pcm16``, the one format every duplex plugin can emit;
    ``auto_response`` makes the session model-native full duplex.
    """
    payload: dict[str, Any] = {
        "model": model,
        "modalities": ["audio", "text"],
        "input_audio_format": "pcm_f32le",
        "output_audio_format": "pcm16",
        "sample_rate_hz": input_rate,
        "audio": {"input": {"sample_rate_hz": input_rate}, "output": {"sample_rate_hz": MODEL_RATE}},
    }
    extra = {"auto_response": True, **dict(overrides.get("extra_body") or {})}
    payload.update({k: v for k, v in overrides.items() if k != "extra_body"})
    payload["extra_body"] = extra
    return payload


def _json_object(text: str, flag: str) -> dict[str, Any]:
    if not text:
        return {}
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value


def standin_builder(max_sessions: int, text_every: int, step_ms: float, **options: Any) -> Callable[[], Any]:
    """The stand-in engine; ``options`` (from --vllm-omni-args) override its settings.

    The test double's module (and vLLM-Omni with it) is imported only when the engine is built.
    """
    settings = {"max_sessions": max_sessions, "text_every": text_every, "step_ms": step_ms, **options}

    def build() -> tuple[Any, Callable[[], None]]:
        from vllm_omni.entrypoints.duplex.audio_encoding import encode_audio

        from duplexserve.testing.vllm_omni_standin import StandInDuplexOmniEngine

        engine = StandInDuplexOmniEngine(duplex_audio_encoder=encode_audio, **settings)
        return engine, engine.shutdown

    return build


def model_builder(model: str, deploy_config: str, args: dict[str, Any]) -> Callable[[], Any]:
    """``DuplexOmni`` builds the engine exactly as ``vllm-omni serve`` does; only its engine is used."""

    def build() -> tuple[Any, Callable[[], None]]:
        from vllm_omni.entrypoints.duplex_omni import DuplexOmni

        kwargs = dict(args)
        if deploy_config:
            kwargs["deploy_config"] = deploy_config
        omni = DuplexOmni(model=model, **kwargs)
        return omni.engine, omni.shutdown

    return build


def vllm_omni_engine_from_config(config: ServerConfig) -> VllmOmniEngine:
    if importlib.util.find_spec("vllm_omni") is None:
        raise RuntimeError(
            "--engine vllm-omni needs vLLM-Omni 0.30 in this environment: "
            "pip install 'duplexserve[vllm-omni]' (docs/vllm-omni.md)"
        )
    overrides = _json_object(config.vllm_omni_session, "--vllm-omni-session")
    args = _json_object(config.vllm_omni_args, "--vllm-omni-args")
    if config.vllm_omni_standin:
        model, rate = STANDIN_MODEL, MODEL_RATE
        defaults = {
            "max_sessions": config.max_sessions,
            "text_every": config.text_every,
            "step_ms": config.step_base_ms,
        }
        build = standin_builder(**{**defaults, **args})
    else:
        model, rate = config.vllm_omni_model, config.vllm_omni_input_rate
        build = model_builder(model, config.vllm_omni_deploy_config, args)
    return VllmOmniEngine(
        config.max_sessions,
        build,
        session_payload=session_payload(model, rate, overrides),
        model=model,
        input_rate=rate,
    )
