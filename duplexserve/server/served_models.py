"""Which model names a request may ask for (``?model=``, a Realtime ``session.model``).

Without ``--served-model-name`` any name is served, and echoed back: OpenAI's SDKs and the
agent frameworks built on them (LiveKit's realtime plugin, pipecat's) always send a model
name of their own (``gpt-realtime``), and one server serves one model whatever it is called.
With it, as vLLM's flag of the same name, only those names are served: a fleet whose gateway
routes on ``?model=`` (docs/deploy-compose.md, docs/deploy-kubernetes.md) sets it on every
replica, so a request that reached the wrong model's replica is refused, never served by it.
"""

from __future__ import annotations

from duplexserve.config import ServerConfig


def served_names(config: ServerConfig) -> list[str]:
    """The names ``GET /v1/models`` lists: those served, else the server's own."""
    return list(config.served_model_name) or [config.model_name]


def not_served(config: ServerConfig, named: object) -> str | None:
    """Why a request naming ``named`` is refused ``model_not_found``; None: it is served
    (no name, any name without ``--served-model-name``, or one of them)."""
    if not named or not config.served_model_name or named in config.served_model_name:
        return None
    shown = named if isinstance(named, str) else repr(named)
    return (f"model {shown[:128]!r}: this server serves {', '.join(config.served_model_name)} "
            "(GET /v1/models)")
