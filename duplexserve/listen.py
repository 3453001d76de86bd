"""The server's listening socket, bound before anything loads; light, so ``duplexserve check``
binds the same way to say whether ``serve`` could listen."""

from __future__ import annotations

import socket


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening) before the model loads, so a busy port is
    said at once rather than after the load; an OSError where it cannot be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own, for a restart
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
