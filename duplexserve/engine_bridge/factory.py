"""Build the engine named in the configuration: in its own process (process_engine.py), or
in this one (local.py); heavy engines import lazily."""

from __future__ import annotations

from duplexserve.config import ServerConfig
from duplexserve.engine_bridge.engine import Engine
from duplexserve.engine_bridge.local import build_local_engine


def build_engine(config: ServerConfig) -> Engine:
    if config.engine_in_process:
        from duplexserve.engine_bridge.process_engine import ProcessEngine

        return ProcessEngine(config)  # builds the engine of local.py in its own process
    return build_local_engine(config)
