"""Build the engine named in the configuration in this process; heavy engines import lazily.

The engine process (process_engine.py) builds its engine here; factory.py picks between
that process and this. Apart, so that neither imports the other: no import circle.
"""

from __future__ import annotations

import dataclasses

from duplexserve.config import ServerConfig
from duplexserve.engine_bridge.engine import Engine
from duplexserve.engine_bridge.synthetic import SyntheticEngine


def build_local_engine(config: ServerConfig) -> Engine:
    if config.engine == "vllm-omni":
        from duplexserve.engine_bridge.vllm_omni.setup import vllm_omni_engine_from_config

        return vllm_omni_engine_from_config(config)
    if config.engine == "moshi":
        from duplexserve.engine_bridge.moshi.engine import moshi_engine_from_config
        from duplexserve.engine_bridge.moshi.presets import served_tokenizer

        return moshi_engine_from_config(dataclasses.replace(config, moshi_tokenizer=served_tokenizer(config)))
    if config.engine == "synthetic":
        return SyntheticEngine(
            config.max_sessions,
            mode=config.synthetic_mode,
            delay_frames=config.delay_frames,
            text_every=config.text_every,
            base_ms=config.step_base_ms,
            per_session_ms=config.step_per_session_ms,
            host_ms_per_session=config.host_ms_per_session,
            faults=config.synthetic_faults,
        )
    raise ValueError(f"engine {config.engine!r} is not available in this build")
