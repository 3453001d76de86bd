"""Where each ``ServerConfig`` field belongs: its group in ``serve --help`` and the engine it is for.

A table by field name and prefix rather than a word on each of the ~100 fields: a field
added later lands in a group by its prefix (``moshi_*``: the moshi engine) or in
"advanced", and its engine is known the same way, with no edit here. Nothing is imported,
so ``config.py`` can read it while it builds the parser.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    """A heading of ``serve --help``: the fields named, then those whose name starts with a prefix."""

    title: str
    description: str
    names: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()


#: In the order ``serve --help`` shows them: what most runs set first, the engines', then the rest.
GROUPS = (
    Group("model", "what is served: the engine and its model (a moshi option alone selects the moshi "
          "engine, a vllm-omni one the vllm-omni engine)",
          ("engine", "moshi_hf_repo", "moshi_weights", "moshi_preset", "device", "voice_prompt_dir",
           "model")),
    Group("server", "where it listens, who may use it, how many at once",
          ("host", "port", "api_keys", "allowed_origins", "metrics_auth", "max_sessions", "log_level")),
    Group("moshi engine", "how the moshi engine runs its model (Moshi, Hibiki, PersonaPlex)",
          ("prompt_cache_mb",), ("moshi_",)),
    Group("synthetic engine", "the stand-in engine of tests and benchmarks (the default: an echo)",
          ("delay_frames", "text_every", "host_ms_per_session"), ("synthetic_", "step_")),
    Group("vllm-omni engine", "vLLM-Omni's DuplexOmniEngine (docs/vllm-omni.md)", (), ("vllm_omni_",)),
    Group("engine scheduling", "how sessions' frames are batched into engine steps", (), ("engine_",)),
    Group("protocols and codecs", "WebSocket, OpenAI Realtime, WebRTC and the audio codecs",
          ("ws",), ("realtime_", "ice_", "webrtc_", "codec_", "opus_")),
    Group("limits", "bounds on one session, one client and the server (docs/reliability.md)",
          ("queue_size", "inflight_frames", "idle_timeout_s", "handshake_timeout_s", "late_frame_ms",
           "client_ipv6_prefix", "resume_grace_s"),
          ("max_", "ws_", "overload_", "drain_")),
)
#: Where a field no group names lands.
ADVANCED = Group("advanced", "deployment behind proxies, and switches for tests and benchmarks")

#: The fields each engine alone reads, by name and by prefix; any other field is every engine's.
ENGINE_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "moshi": (("device", "voice_prompt_dir", "prompt_cache_mb"), ("moshi_",)),
    "vllm-omni": ((), ("vllm_omni_",)),
    "synthetic": (("delay_frames", "text_every", "host_ms_per_session"), ("synthetic_", "step_")),
}


def group_of(name: str) -> Group:
    """The group of field ``name``: the first naming it, else the first with its prefix, else advanced."""
    for group in GROUPS:
        if name in group.names:
            return group
    for group in GROUPS:
        if name.startswith(group.prefixes) and group.prefixes:
            return group
    return ADVANCED


def engine_of(name: str) -> str | None:
    """The engine that alone reads field ``name``; None for a field of every engine."""
    for engine, (names, prefixes) in ENGINE_FIELDS.items():
        if name in names or (prefixes and name.startswith(prefixes)):
            return engine
    return None
