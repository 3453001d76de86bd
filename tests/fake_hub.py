"""A Hugging Face Hub on loopback, for ``HF_ENDPOINT``: the file routes huggingface_hub downloads by.

``hf_hub_download`` asks ``HEAD /OWNER/NAME/resolve/REVISION/FILE`` for the commit
(``X-Repo-Commit``), the blob's ``ETag`` and its size, then ``GET``s it (a ``Range`` to
resume a partial file); errors are told by ``X-Error-Code`` (``RepoNotFound``, ``GatedRepo``,
``EntryNotFound``), as the Hub answers. Every request is recorded, with its token.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

COMMIT = "feedc0de" * 5


@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)  # repo -> file -> content
    gated: dict[str, str] = field(default_factory=dict)  # repo -> the token that opens it
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # method, path, Authorization

    def add_folder(self, repo: str, folder: Path) -> None:
        self.repos[repo] = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}

    def start(self) -> str:
        """Serve in a thread; the endpoint for ``HF_ENDPOINT``."""
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files_asked(self, method: str = "GET") -> list[str]:
        return [path.rpartition("/")[2] for m, path, _ in self.requests if m == method]

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(handler.path.split("?")[0])
        self.requests.append((handler.command, path, handler.headers.get("Authorization", "")))
        owner, name, resolve, _revision, filename = ([*path.strip("/").split("/", 4), "", "", ""])[:5]
        repo = f"{owner}/{name}"
        if resolve != "resolve" or repo not in self.repos:
            return self._error(handler, 401, "RepoNotFound")
        if repo in self.gated and handler.headers.get("Authorization") != f"Bearer {self.gated[repo]}":
            return self._error(handler, 403, "GatedRepo")
        content = self.repos[repo].get(filename)
        if content is None:
            return self._error(handler, 404, "EntryNotFound")
        start = 0
        ranged = handler.headers.get("Range", "")
        if ranged.startswith("bytes="):
            start = int(ranged[6:].split("-")[0] or 0)
        handler.send_response(206 if start else 200)
        handler.send_header("X-Repo-Commit", COMMIT)
        handler.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
        handler.send_header("Content-Length", str(len(content) - start))
        handler.end_headers()
        if body:
            handler.wfile.write(content[start:])

    @staticmethod
    def _error(handler: BaseHTTPRequestHandler, status: int, code: str) -> None:
        handler.send_response(status)
        handler.send_header("X-Error-Code", code)
        handler.send_header("X-Error-Message", code)
        handler.send_header("X-Repo-Commit", COMMIT)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
