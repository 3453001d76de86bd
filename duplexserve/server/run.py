"""Run the app under uvicorn with uvloop and httptools, deflate off for audio."""

from __future__ import annotations

import uvicorn

from duplexserve.config import ServerConfig
from duplexserve.server.app import create_app


def uvicorn_config(config: ServerConfig, app: object) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        ws=config.ws,
        ws_per_message_deflate=False,
        # A hard backstop above our own limit, which answers with an error event first.
        ws_max_size=2 * config.max_message_bytes + 1024,
        lifespan="on",
        log_level=config.log_level,
        access_log=False,
        backlog=4096,
    )


def serve(config: ServerConfig) -> None:
    server = uvicorn.Server(uvicorn_config(config, create_app(config)))
    server.run()
