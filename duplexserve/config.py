"""Server configuration: one dataclass, exposed as CLI flags and ``DUPLEXSERVE_*`` variables.

Each field carries its help text, so ``duplexserve serve --help`` documents every
setting and the environment names are derived, never written twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "DUPLEXSERVE_"


def _opt(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class ServerConfig:
    host: str = _opt("127.0.0.1", "address to listen on")
    port: int = _opt(8998, "TCP port to listen on")
    ws: str = _opt(
        "websockets-sansio",
        "uvicorn WebSocket implementation (chosen by measurement, see docs/benchmarks.md)",
        ("websockets-sansio", "websockets"),
    )
    log_level: str = _opt("info", "log level", ("critical", "error", "warning", "info", "debug"))
    model: str = _opt("synthetic-echo", "model name reported in session.created")

    # Engine.
    engine: str = _opt("synthetic", "engine behind the bridge", ("synthetic", "moshi", "vllm-omni"))
    synthetic_mode: str = _opt("echo", "synthetic engine mode", ("echo", "silence"))
    delay_frames: int = _opt(0, "synthetic engine: output frame i answers input frame i - delay")
    text_every: int = _opt(5, "synthetic engine: emit a text.delta every N frames (0: never)")
    step_base_ms: float = _opt(0.0, "synthetic step model: fixed wait per step, GIL released")
    step_per_session_ms: float = _opt(0.0, "synthetic step model: extra wait per session in the batch")
    host_ms_per_session: float = _opt(
        0.0, "synthetic step model: Python work per session per step, holding the GIL"
    )
    moshi_preset: str = _opt("tiny", "moshi engine: architecture preset with random weights")
    moshi_weights: str = _opt("", "moshi engine: folder with local weights (nothing is downloaded)")
    device: str = _opt("auto", "moshi engine: torch device (auto, cpu, cuda)")

    # Admission and bounds.
    max_sessions: int = _opt(256, "sessions served at once (engine slots); more get 1013")
    queue_size: int = _opt(256, "bound of the janus queue into the engine thread")
    inflight_frames: int = _opt(
        8, "frames of one session handed to the engine and not yet answered, at most"
    )
    max_pending_frames: int = _opt(
        64, "frames of one session buffered before the engine; past it, reading pauses"
    )
    max_output_frames: int = _opt(
        256, "frames queued toward one client; a client that falls further behind is closed"
    )
    max_message_bytes: int = _opt(1 << 20, "largest WebSocket message accepted (1009 beyond)")
    idle_timeout_s: float = _opt(30.0, "close a session that sends nothing for this long")
    max_session_s: float = _opt(0.0, "longest session in seconds (0: no limit)")

    # Security.
    api_keys: str = _opt("", "comma-separated API keys; empty: no authentication")
    allowed_origins: str = _opt("", "comma-separated Origins browsers may connect from; empty: any")

    # Behaviour switches used by benchmarks.
    offload_every_frame: bool = _opt(
        False,
        "benchmark only: hop to a thread pool for the audio conversion and for the queue put "
        "on every frame, as vLLM-Omni's frontend did",
    )

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field; defaults come from the environment when set there."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            env = ENV_PREFIX + f.name.upper()
            default = _from_env(env, f.default)
            help_text = f"{f.metadata['help']} [env {env}; default %(default)s]"
            if isinstance(f.default, bool):
                parser.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
                )
            else:
                parser.add_argument(
                    flag,
                    type=type(f.default),
                    default=default,
                    choices=f.metadata["choices"],
                    help=help_text,
                )

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerConfig:
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})

    def validate(self) -> None:
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        if self.queue_size < 1 or self.inflight_frames < 1:
            raise ValueError("queue_size and inflight_frames must be at least 1")
        if self.max_pending_frames < 1 or self.max_output_frames < 1:
            raise ValueError("max_pending_frames and max_output_frames must be at least 1")
        if self.delay_frames < 0 or self.text_every < 0:
            raise ValueError("delay_frames and text_every cannot be negative")


def _from_env(name: str, default: Any) -> Any:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return type(default)(raw)
